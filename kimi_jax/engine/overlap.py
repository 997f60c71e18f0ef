"""Overlapped decode steps (vLLM's async scheduling, ``EngineConfig.async_scheduling``; on by default on
an accelerator): the next decode step is dispatched before this one's tokens are read, its input tokens taken on
the device from this step's sampled tokens. The host work between two steps -- reading the tokens, detokenizing,
stop checks, streaming, building the next inputs, the dispatch itself -- then runs while the device computes,
instead of between its steps.

A step chains from the one in flight only where the next step's inputs are known without its tokens: plain decoding
(no speculation), no guided row (a grammar's mask depends on the token), every running sequence emitting and the
same sequences as in flight, nothing to admit (a new request, an abort, a prefill, a free slot for a waiting
request or a shutdown goes through the synchronous path, which first reads the step in flight; a waiting request
whose admission failed is tried again only once a slot, a page, a prefix-cache store or a sequence's end could
change the answer), room for one more
position in every sequence and the page it lands in free (prefix-cache pages are evicted for it; nothing is
preempted). Everything else the chained step
takes is the in-flight step's inputs with the generated-token index one further, so its tokens equal the
synchronous engine's bit for bit.

A sequence that ends on a step whose successor is already in flight has had its last token fed by that successor:
the successor's row for it is dropped unread, and the prefix-cache checkpoint taken as it ends counts that token
(`_fed_ahead`): the cache then holds its whole prompt and answer.

Across processes (`multihost.Mirror`) the successor is a mirrored call like any other: process 0 publishes it
before it reads the step in flight, and its input tokens travel as a reference to the array each process's own
step produced, so every process runs the same calls in the same order.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .sampler import Controls


@dataclass(eq=False)
class _Step:
    """A dispatched decode step whose outputs are not read yet, and the inputs it ran with."""

    out: object  # the runner's SampleOut: device arrays, one row per program row (`slots` order, else by slot)
    seqs: dict  # slot -> the _Seq the step advances
    emit: np.ndarray  # bool [B] by slot: the row's output is a token to hand out
    slots: Optional[np.ndarray]  # int32 [b]: the bucket's slots; None: all B rows
    active: np.ndarray  # bool, program rows (as passed)
    rows: object  # the uploaded sampling rows (device)
    ctl: Controls  # program rows (as passed)
    plain: bool  # ran the plain sampler (its successor runs the same sequences: it may too)


class OverlapMixin:
    """`Engine`'s overlapped steps: `_dispatch` runs a decode step and keeps its record, `_overlap` finishes the step
    in flight after dispatching its successor where one can chain (`_may_chain`, `_chain`)."""

    def _dispatch(self, tokens, active, rows, ctl: Controls, tables, slots, seqs: dict, emit, plain: bool) -> _Step:
        """Run the decode step over `slots` (None: all rows): tokens, active, ctl and tables in program rows
        (tokens may be a device array); `plain`: with the plain sampler (`Engine._plain_sampler`)."""
        self._count_step(slots, plain)
        t0 = time.perf_counter()
        self._state, out = self.runner.step(self._state, tokens, active, rows, ctl, tables,
                                            sampling_tables=self._tables, slots=slots, plain=plain)
        self.step_dispatch_seconds += time.perf_counter() - t0
        return _Step(out, seqs, emit, slots, active, rows, ctl, plain)

    def _overlap(self) -> bool:
        """Finish the step in flight, first dispatching its successor where it can chain. True: a successor is in
        flight now and this iteration is done; False: the synchronous path runs next."""
        step, self._inflight = self._inflight, None
        nxt = self._chain(step) if self._may_chain(step) else None
        self._fed_ahead = {} if nxt is None else nxt.seqs
        try:
            self._finish_step(step)
        finally:
            self._fed_ahead = {}
        self._inflight = nxt
        return nxt is not None

    def _may_chain(self, step: _Step) -> bool:
        """Whether the step after `step` can be dispatched before `step`'s tokens are read (module docstring); takes
        the pages it needs when it can."""
        if not self.async_scheduling or self.proposer is not None or self._stop.is_set():
            return False
        if self._prefilling is not None or self._vision_pending or not self._inbox.empty():
            return False
        if self._waiting and self._free and not self._head_still_blocked():
            return False  # a waiting request may be admitted now (with every slot taken, or pages short, none can)
        if self._running.keys() != step.seqs.keys():
            return False
        for slot, seq in self._running.items():
            # the successor writes position fed + 1 (fed: the position `step` writes; not counted yet)
            if (step.seqs[slot] is not seq or not step.emit[slot] or seq.guide is not None
                    or len(seq.pending) != 1 or seq.fed + 2 > self.max_model_len):
                return False
        for seq in sorted(self._running.values(), key=lambda s: s.order):
            while not self.alloc.can_allocate(seq.key, seq.fed + 2):
                if not self.prefix_cache.evict_lru():
                    return False
            self.alloc.allocate(seq.key, seq.fed + 2)
        return True

    def _chain(self, step: _Step) -> _Step:
        """Dispatch the step after `step`: its sampled tokens (still on the device) as the input tokens, one more
        generated token per row, the block table with any page the rows grew into (a copy where it changed: the
        table `step` took may still be read)."""
        tables = self._block_table.update({slot: self.alloc.held(seq.key) for slot, seq in self._running.items()},
                                          lent=True)
        if step.slots is not None:
            tables = tables[step.slots]
        ctl = step.ctl._replace(gen_step=step.ctl.gen_step + 1)
        self.steps_overlapped += 1
        return self._dispatch(step.out.tokens, step.active, step.rows, ctl, tables, step.slots, dict(step.seqs),
                              step.emit, step.plain)
