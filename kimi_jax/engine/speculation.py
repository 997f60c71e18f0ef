"""Speculative decoding's host side for ``Engine`` (docs/model.md §12; the acceptance rule runs on device,
``spec_decode.py``): which rows draft and how far (``_draft``), a guided row's drafts from a walk over a copy of its
guide (``_guided_drafts``), the verify program's inputs (``_verify_inputs``, ``_draft_q``: the q of sampled drafts)
and its counts (``_count_verify``).  Also the class table's dynamic rows, one per slot and verify position, that
carry a step's bitmask constraints (``_constraint_class``, the one-token step's position 0 included;
``_upload_dynamic_masks``).

``SpeculationMixin`` is a base of ``Engine`` and runs on the engine thread only.
Reads: ``B``, ``vocab_size``, ``max_model_len``, ``class_masks``, ``runner``, ``_running``.
Writes: ``alloc`` (the pages drafts land in), ``_dyn_bits`` / ``_dyn_dirty`` / ``_tables`` (the dynamic rows and
the table passed to every step), ``_q_zeros``; the counters ``spec_steps``, ``spec_drafted``, ``spec_accepted``.
"""

from __future__ import annotations

import copy

import jax.numpy as jnp
import numpy as np

from .draft_model import DraftRequest
from .guide import ALL, ONLY_IDS, Constraint, Guide, MAX_ALLOWED_IDS
from .sampler import Controls, seed32
from .sequences import _Context
from .spec_policy import SpecPolicy


class SpeculationMixin:
    """Drafting and the verify step's inputs: a base of ``Engine`` (its attributes: above)."""

    def _draft(self, proposer, policy: SpecPolicy, emit: np.ndarray, active_rows: int, constraints: dict):
        """This step's drafts: ({slot: (tokens, leading forced ones)}, {slot: constraints at positions 1..v} for
        guided rows); both empty when the policy finds a verify step not worth it.  A row drafts when it emits and
        has room left under max_tokens / max_model_len, and only as far as the pages it holds and the free ones
        reach (drafts never preempt).  A guided row drafts what its guide forces and the prompt-lookup tokens its
        guide allows (``_guided_drafts``)."""
        proposals, later, rooms = {}, {}, {}
        for slot, seq in self._running.items():
            if not emit[slot]:
                continue
            p = seq.req.params
            produced = len(seq.req.prompt_ids) + len(seq.output_ids)
            room = min(p.max_tokens - len(seq.output_ids) - 1, self.max_model_len - produced - 1,
                       self.runner.spec_tokens)
            if room >= 1:
                rooms[slot] = room
        # the most any proposal could bring (every row drafting its room, a guided row's all certain): when even that
        # would not pay for a verify step, nothing is proposed -- a draft model's forward passes are not wasted
        keys = {slot: self._running[slot].key for slot in rooms}
        if not policy.worth_verifying({keys[s]: r for s, r in rooms.items()}, active_rows,
                                      {keys[s]: r for s, r in rooms.items() if self._running[s].guide is not None}):
            return {}, {}
        samples, batched = getattr(proposer, "samples", False), getattr(proposer, "rows", 0) >= self.B
        if samples and not (batched and self.runner.draft_q):
            # sampled drafts verified as one-hot, or their q lost between rows, would bias the output
            raise RuntimeError("a proposer that samples its drafts must batch every slot (rows >= max_num_seqs) "
                               "and needs a runner built with draft_q=True")
        requests = {}
        for slot, room in rooms.items():
            seq = self._running[slot]
            ctx = _Context(seq.req.prompt_ids, seq.output_ids)
            if samples:
                # a guided row drafts greedily: its drafts' number depends on their values (the guide's walk),
                # which for sampled drafts would bias the output; deterministic drafts can be cut anywhere
                hot = seq.guide is None and seq.req.params.temperature > 0
                requests[slot] = DraftRequest(seq.key, ctx, room, seq.req.params.temperature if hot else 0.0,
                                              seed32(seq.req.seed), seq.index, len(seq.output_ids))
            else:
                requests[slot] = DraftRequest(seq.key, ctx, room)
        if batched:  # a draft model: every row's drafts in one batch (row = slot)
            batch = proposer.propose_batch([requests.get(s) for s in range(self.B)])
            drafted = {slot: batch[slot] for slot in requests}
        else:
            drafted = {s: proposer.propose(r.seq_id, r.tokens, r.max_tokens) for s, r in requests.items()}
        for slot, room in rooms.items():
            seq, d = self._running[slot], drafted[slot]
            sure = 0
            if seq.guide is not None:
                d, sure, later[slot] = self._guided_drafts(seq.guide, constraints.get(slot), d, room)
            if d:
                proposals[slot] = (d, sure)
        if not policy.worth_verifying({self._running[s].key: len(d) for s, (d, _) in proposals.items()}, active_rows,
                                      {self._running[s].key: sure for s, (_, sure) in proposals.items()}):
            return {}, {}
        drafts = {}
        for slot, (d, sure) in proposals.items():
            seq = self._running[slot]
            v = len(d)
            while v and not self.alloc.can_allocate(seq.key, seq.fed + 1 + v):
                v -= 1
            if v:
                self.alloc.allocate(seq.key, seq.fed + 1 + v)
                drafts[slot] = (d[:v], min(sure, v))
                if slot in later:
                    later[slot] = later[slot][:v]
        return drafts, {s: cons for s, cons in later.items() if s in drafts}

    def _guided_drafts(self, guide: Guide, con, proposal: list, limit: int):
        """Drafts for a guided row, walked on a copy of its guide: each token the guide forces (a constraint of one
        id), else the next prompt-lookup token while the drafts still follow that proposal and the guide allows it.
        Returns (drafts, how many lead the list forced -- certain to be kept --, the constraint at positions
        1..len(drafts): the guide's state after each draft, None = free).  Any failure of the copy: no drafts."""
        drafts, cons, sure = [], [], 0
        try:
            g = copy.deepcopy(guide)
            for i in range(limit):
                if con is not None and con.vocab_class == ONLY_IDS and len(con.ids) == 1:
                    t = con.ids[0]
                    sure += sure == i
                elif (i < len(proposal) and drafts == proposal[:i]
                      and (con is None or con.allows(proposal[i], self.class_masks))):
                    t = proposal[i]
                else:
                    break
                g.advance(t)
                drafts.append(t)
                if g.finished:  # the sequence ends on this token: nothing after it is used
                    cons.append(None)
                    break
                con = g.constraint()
                if con is not None and len(con.ids) > MAX_ALLOWED_IDS:  # not expressible: stop before this draft
                    drafts.pop()
                    sure = min(sure, len(drafts))
                    break
                cons.append(con)
        except Exception:  # noqa: BLE001 -- a guide that cannot be copied or walked simply does not draft
            return [], 0, []
        return drafts, sure, cons[: len(drafts)]

    def _verify_inputs(self, tokens: np.ndarray, ctl: Controls, drafts: dict, later: dict):
        """The verify program's inputs by slot: ``ids`` ``[B, k+1]`` (each row's token to feed, then its drafts),
        ``n_draft`` ``[B]`` and the one-token step's controls ``ctl`` widened to ``[B, k+1]`` constraints --
        position 0's for every row, then a guided row's after each of its drafts (``later``, from ``_draft``)."""
        B, V, K = self.B, self.vocab_size, self.runner.spec_tokens
        ids = np.zeros((B, K + 1), np.int32)
        ids[:, 0] = tokens
        n_draft = np.zeros(B, np.int32)
        for slot, (d, _) in drafts.items():
            ids[slot, 1: 1 + len(d)] = d
            n_draft[slot] = len(d)
        allow_class = np.repeat(ctl.allow_class[:, None], K + 1, axis=1)
        allow_ids = np.repeat(ctl.allow_ids[:, None], K + 1, axis=1)
        for slot, cons in later.items():
            for i, con in enumerate(cons, start=1):
                allow_class[slot, i] = ALL if con is None else self._constraint_class(con, slot, i)
                allow_ids[slot, i] = V
                if con is not None:
                    allow_ids[slot, i, : len(con.ids)] = con.ids
        return ids, n_draft, ctl._replace(allow_class=allow_class, allow_ids=allow_ids)

    def _draft_q(self, proposer, drafts: dict) -> dict:
        """The verify program's ``q`` ``[B, k, V]`` (device) and ``has_q`` ``[B, k]`` for this step's drafts: the
        batched proposer's q, by slot (rows that did not sample hold values the program ignores)."""
        B, K = self.B, self.runner.spec_tokens
        has_q = np.zeros((B, K), bool)
        if not getattr(proposer, "samples", False):  # a deterministic proposer swapped in: every draft one-hot
            if self._q_zeros is None:
                self._q_zeros = jnp.zeros((B, K, self.vocab_size), jnp.float32)
            return {"q": self._q_zeros, "has_q": has_q}
        for slot, (d, _) in drafts.items():
            has_q[slot, :len(d)] = proposer.sampled(self._running[slot].key)
        q = proposer.batch_q()
        return {"q": q if q.shape[0] == B else q[:B], "has_q": has_q}

    def _count_verify(self, policy: SpecPolicy, drafts: dict, n_draft: np.ndarray, n: np.ndarray) -> None:
        """Count a verify step's drafts and accepted tokens (``n`` ``[B]``: tokens each slot emitted) and tell the
        policy each drafting row's outcome (its forced drafts, certain to be kept, left out)."""
        self.spec_steps += 1
        self.spec_drafted += int(n_draft.sum())
        for slot, (d, sure) in drafts.items():
            kept = int(n[slot]) - 1
            self.spec_accepted += kept
            policy.observe(self._running[slot].key, len(d) - sure, max(kept - sure, 0))

    def _constraint_class(self, con: Constraint, slot: int, pos: int) -> int:
        """The class-table row a constraint selects: its vocabulary class, or -- for a bitmask constraint -- the
        slot's dynamic row for verify position ``pos``, filled with its bits for this step."""
        if con.bits is None:
            return con.vocab_class
        row = slot * self._dyn_per_slot + pos
        self._dyn_bits[row] = con.bits
        self._dyn_dirty = True
        return self._dyn_base + row

    def _upload_dynamic_masks(self) -> None:
        """Put this step's bitmask rows into the runner's class table (one packed upload, unpacked on device)."""
        if not self._dyn_dirty:
            return
        self._dyn_dirty = False
        self._tables = self.runner.update_class_masks(self._tables, self._dyn_bits, self._dyn_base)
