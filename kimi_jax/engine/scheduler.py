"""Scheduling for ``Engine``: admission of waiting requests and preempted sequences (slots, pages, the vision
tower's run for image prompts), chunked prefill within ``prefill_token_budget``, the prefix cache's lookups and
snapshots, and before each decode step page growth with preemption by recompute (the policy: engine.py's module
docstring, items 1-2 and "Pages").

``SchedulerMixin`` is a base of ``Engine`` and runs on the engine thread only.
Reads: ``config``, ``model``, ``tokenizer``, ``runner``, ``vocab_size``, ``_abort_posted``.
Reads and writes: ``_waiting``, ``_prefilling``, ``_vision_pending``, ``_running``, ``_free``, ``_orders``,
``_state``, ``alloc``, ``prefix_cache``, ``_prefix_blocks``, ``rows``; the counters ``num_prefill_chunks``,
``token_split_prefill_tokens``, ``prompt_tokens_total``, ``num_preemptions``, ``images_encoded``.
Ends a request whose images fail through ``OutputMixin._end_seq`` / ``_finish_request``.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Optional

import numpy as np

from .detok import OutputText
from .images import encode_many
from .sequences import _Prefill, _Seq, _request_of

log = logging.getLogger("kimi_jax.engine")


class SchedulerMixin:
    """Admission, prefill, the prefix cache, pages and preemption: a base of ``Engine`` (its attributes: above)."""

    # ------------------------------------------------------------------------------------------------ prefill
    def _prefill_some(self) -> None:
        """Prefill waiting requests (and preempted sequences, which wait at the front).  Once any sequence is decoding,
        stop after ``prefill_token_budget`` prompt tokens (at least one chunk) so that the decode step runs again; the
        rest continues next iteration."""
        budget = self.config.prefill_token_budget
        spent = 0
        self._vision_pending = False
        while True:
            job = self._prefilling
            if job is None:
                if not self._waiting or (self._running and spent >= budget):
                    return
                ready = self._images_ready(self._waiting[0])
                if ready is None:
                    continue  # that request failed and is gone
                if not ready:
                    self._vision_pending = True  # compiling in the background; the others keep decoding
                    return
                if not self._encode_images(self._waiting[0]):
                    continue  # that request failed and is gone
                job = self._admit(self._waiting[0])
                if job is None:
                    return  # not enough free slots or pages yet
                self._waiting.popleft()
            while job.chunks:
                size = job.chunks[0]
                if self._running and spent > 0 and spent + size > budget:
                    return  # resume next iteration, after a decode step
                if job.req.request_id in self._abort_posted:
                    return  # the next intake takes the abort and cancels this prefill
                ids = np.asarray(job.ids[job.pos: job.pos + size], np.int32)
                table = self.alloc.block_table([job.keys[0]], self.runner.max_blocks)
                pi = job.req.images
                mm = pi.chunk_inputs(job.pos, size) if pi is not None else None
                job.cache1, self._state = self.runner.prefill(job.cache1, ids, self._state, table, mm=mm)
                job.chunks.pop(0)
                job.pos += size
                spent += size
                self.num_prefill_chunks += 1
                if self.runner.splits_tokens(size, images=mm is not None):
                    self.token_split_prefill_tokens += size
            self._finish_prefill(job)

    def _images_ready(self, item) -> Optional[bool]:
        """Whether a waiting request's images can be encoded now (their tower programs compiled; compiles start in
        the background otherwise, and the first wait is logged).  A failed compile ends the request like a failed
        encode: None then."""
        req = _request_of(item)
        if req.images is None:
            return True
        try:
            ready = req.images.ready(self.model)
        except Exception:  # noqa: BLE001 -- one request's images must not take the engine down
            log.exception("vision tower failed to compile for the images of request %s; aborting it", req.request_id)
            self._drop_waiting(item)
            return None
        if not ready and not req.waited_for_vision:
            req.waited_for_vision = True
            log.info("%s waits for the vision tower to compile for its image size (patch buckets %s); running "
                     "sequences keep decoding", req.request_id, req.images.buckets(self.model.config.vision))
        return ready

    def _drop_waiting(self, item) -> None:
        """Take a waiting request (or preempted sequence) whose images failed off the queue and end it."""
        self._waiting.popleft()
        if isinstance(item, _Seq):
            self._end_seq(item, "abort", None, [])
        else:
            self._finish_request(item)

    def _encode_images(self, item) -> bool:
        """Run the vision tower for a waiting request's images (once: a resumed sequence has them).  A failure
        ends that request (aborted, logged) and takes it off the queue; returns False then."""
        req = _request_of(item)
        if req.images is None or req.images.features is not None:
            return True
        ahead = self._images_ahead(len(req.images.counts))
        if ahead:
            try:  # the head's images and those of the requests behind it, in one tower call
                encode_many([req.images] + ahead, self.model)
                self.images_encoded += len(req.images.counts) + sum(len(p.counts) for p in ahead)
                return True
            except Exception:  # noqa: BLE001 -- find whose images fail: the head's alone now, the others' later
                log.warning("vision tower failed on a batch of %d requests' images; encoding request %s alone",
                            1 + len(ahead), req.request_id)
        try:
            req.images.encode(self.model)
        except Exception:  # noqa: BLE001 -- one request's images must not take the engine down
            log.exception("vision tower failed on the images of request %s; aborting it", req.request_id)
            self._drop_waiting(item)
            return False
        self.images_encoded += len(req.images.counts)
        return True

    def _images_ahead(self, head_images: int) -> list:
        """The not yet encoded images (`PromptImages`) of the requests waiting behind the queue's head whose tower
        programs are compiled, in queue order, while the images stay within `vision_batch_images` with the head's
        ``head_images``; an image-less request does not end the walk, one whose images do not fit does."""
        room = self.config.vision_batch_images - head_images
        ahead = []
        for item in list(self._waiting)[1:]:
            if room <= 0:
                break
            pi = _request_of(item).images
            if pi is None or pi.features is not None:
                continue
            if len(pi.counts) > room:
                break
            try:
                if not pi.ready(self.model):
                    continue  # its programs are compiling (started now, if not before)
            except Exception:  # noqa: BLE001 -- its own turn at the head reports and ends it
                continue
            ahead.append(pi)
            room -= len(pi.counts)
        return ahead

    def _admit(self, item) -> Optional[_Prefill]:
        """Start the prefill of a waiting request or preempted sequence, if slots and pages allow."""
        if isinstance(item, _Seq):
            req, n = item.req, 1
            ids, keys = req.prompt_ids + item.output_ids, [item.key]
        else:
            req, n = item, item.n
            ids, keys = req.prompt_ids, [(req.request_id, i) for i in range(n)]
        if len(self._free) < n:
            return None
        prefill_ids = ids[:-1]
        key = req.images.cache_key(ids) if req.images is not None else ids
        chunks, _ = self.runner.plan_chunks(len(prefill_ids))
        prefill_len = sum(chunks)
        # the prefill's pages up front, plus one page of headroom per running sequence (so that admitting it does
        # not immediately force a preemption)
        need = n * self.alloc.blocks_for_tokens(prefill_len) + len(self._running)
        while self.alloc.free_blocks < need and self.prefix_cache.evict_lru():
            pass
        if self.alloc.free_blocks < need:
            return None
        self._orders += 1
        job = _Prefill(req, ids, item if isinstance(item, _Seq) else None, keys,
                       [self._free.pop() for _ in range(n)], self._orders, chunks, key, prefill_len=prefill_len)
        for k in keys:
            self.alloc.allocate(k, prefill_len)
        hit = self.prefix_cache.lookup(key[:prefill_len])
        if hit is not None and req.images is not None:
            # chunk sizes that do not divide one another can leave a hit's remainder short of the last image
            # token; that token would then ride a decode step without its features -- prefill from scratch instead
            rest, _ = self.runner.plan_chunks(prefill_len - hit[0])
            if hit[0] + sum(rest) < req.images.end:
                hit = None
        if hit is not None:
            job.pos, (job.cache1, owner) = hit
            used = self.alloc.blocks_for_tokens(job.pos)
            self._state = self.runner.copy_blocks(self._state, self.alloc.blocks(owner)[:used],
                                                  self.alloc.blocks(keys[0])[:used])
            if job.seq is None:
                req.cached_tokens = job.pos
            job.chunks, _ = self.runner.plan_chunks(prefill_len - job.pos)
            # the chunks may not cover the rest exactly (sizes that do not divide one another, e.g. 64 and 48): the
            # prefill then ends, and its snapshot is taken, at pos + sum(chunks); the remainder rides the decode steps
            job.prefill_len = job.pos + sum(job.chunks)
        else:
            job.cache1 = self.runner.new_cache1()
        self._prefilling = job
        return job

    def _cancel_prefill(self) -> Optional[_Prefill]:
        """Drop the prefill in progress: its pages and slots go back; returns it."""
        job = self._prefilling
        if job is not None:
            self._prefilling = None
            for k in job.keys:
                self.alloc.free(k, missing_ok=True)
            self._free.extend(job.slots)
            job.slots, job.cache1 = [], None
        return job

    def _finish_prefill(self, job: _Prefill) -> None:
        self._prefilling = None
        req = job.req
        if job.prefill_len:
            self._store_prefix(job)
            src = self.alloc.blocks(job.keys[0])
            for k in job.keys[1:]:  # the other sequences start from copies of the first one's pages
                self._state = self.runner.copy_blocks(self._state, src, self.alloc.blocks(k))
        mask_row = np.zeros(self.vocab_size, bool)
        mask_row[req.prompt_ids] = True
        tail = job.ids[job.pos:]
        if job.seq is None:
            self.prompt_tokens_total += len(req.prompt_ids)
            for i, slot in enumerate(job.slots):
                guide = req.guide_factory() if req.guide_factory is not None else None
                text = OutputText(self.tokenizer, req.params.stop, req.params.include_stop_str_in_output)
                req.seqs.append(_Seq(req, i, slot, deque(), text, guide))
        for slot, seq in zip(job.slots, [job.seq] if job.seq is not None else req.seqs):
            counts = np.bincount(seq.output_ids, minlength=self.vocab_size).astype(np.int32)
            self._state = self.runner.insert(self._state, job.cache1, slot, mask_row, counts)
            self.rows.set(slot, req.params, req.seed, seq.index)
            seq.slot, seq.pending, seq.fed, seq.order = slot, deque(tail), job.pos, job.order
            self._running[slot] = seq
        job.cache1 = None

    def _store_prefix(self, job: _Prefill) -> None:
        """Snapshot the prefilled prefix: KDA state + private copies of its pages (skipped when pages are short)."""
        if self.prefix_cache.capacity <= 0:
            return
        need = self.alloc.blocks_for_tokens(job.prefill_len)
        if self.alloc.free_blocks < need:
            return
        self._orders += 1
        owner = ("prefix", self._orders)
        self.alloc.allocate(owner, job.prefill_len)
        self._prefix_blocks += need
        self._state = self.runner.copy_blocks(self._state, self.alloc.blocks(job.keys[0])[:need],
                                              self.alloc.blocks(owner))
        self.prefix_cache.store(job.key[: job.prefill_len], (job.cache1, owner))

    def _drop_prefix(self, entry) -> None:
        self._prefix_blocks -= self.alloc.free(entry[1])

    # ------------------------------------------------------------------------------------------------ pages
    def _grow(self) -> None:
        """Give every running sequence the page its next token lands in, oldest first; preempt when out of pages."""
        for seq in sorted(self._running.values(), key=lambda s: s.order):
            if self._running.get(seq.slot) is not seq:
                continue  # preempted below for an older sequence
            while not self.alloc.can_allocate(seq.key, seq.fed + 1):
                if self.prefix_cache.evict_lru():
                    continue
                victim = self._youngest()
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                self.alloc.allocate(seq.key, seq.fed + 1)

    def _youngest(self):
        cands = list(self._running.values()) + ([self._prefilling] if self._prefilling is not None else [])
        return max(cands, key=lambda x: x.order)

    def _preempt(self, victim) -> None:
        """Free a running sequence (or the prefill in progress) and queue it, first, for recompute."""
        self.num_preemptions += 1
        if isinstance(victim, _Prefill):
            job = self._cancel_prefill()
            self._waiting.appendleft(job.seq if job.seq is not None else job.req)
            if job.seq is None:
                job.req.cached_tokens = 0
            log.info("preempted the prefill of request %s (out of cache pages)", job.req.request_id)
            return
        seq = victim
        del self._running[seq.slot]
        self._free.append(seq.slot)
        self.alloc.free(seq.key, missing_ok=True)
        seq.slot, seq.pending, seq.fed = None, deque(), 0
        seq.preemptions += 1
        self._waiting.appendleft(seq)
        log.info("preempted sequence %s of request %s after %d tokens (out of cache pages)", seq.index,
                 seq.req.request_id, len(seq.req.prompt_ids) + len(seq.output_ids))
