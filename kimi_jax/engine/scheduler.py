"""Scheduling for ``Engine``: admission of waiting requests and preempted sequences (slots, pages, the vision
tower's run for image prompts), chunked prefill within ``prefill_token_budget``, the prefix cache's lookups and
checkpoints, and before each decode step page growth with preemption by recompute (the policy: engine.py's module
docstring, items 1-2 and "Pages").

``SchedulerMixin`` is a base of ``Engine`` and runs on the engine thread only.
Reads: ``config``, ``model``, ``tokenizer``, ``runner``, ``vocab_size``, ``_abort_posted``.
Reads and writes: ``_waiting``, ``_prefilling``, ``_vision_pending``, ``_running``, ``_free``, ``_orders``,
``_state``, ``alloc``, ``prefix_cache``, ``rows``; the counters ``num_prefill_chunks``,
``token_split_prefill_tokens``, ``prompt_tokens_total``, ``num_preemptions``, ``images_encoded``,
``prefix_query_tokens``, ``prefix_hit_tokens``, ``prefix_hits``.

The prefix cache (``prefix_cache.py``) gets a checkpoint, with the pages before it, at these points:
* during a prefill, where a chunk ends on a multiple of ``checkpoint_blocks`` pages, and where the prompt leaves the
  cached pages (the page boundary up to which it matched full pages beyond its own hit: two prompts share that much,
  so a third is likely to) -- the chunk plan is cut so that a chunk ends there;
* at the end of every prefill (a prompt asked again, or the ``n`` of another request);
* when a running sequence finishes or is preempted, after its last fed token (a conversation's next turn carries
  this turn's prompt and answer; a preempted sequence's recompute resumes right there).
Ends a request whose images fail through ``OutputMixin._end_seq`` / ``_finish_request``.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Optional

import numpy as np

from .detok import OutputText
from .images import encode_many
from .prefix_cache import Match
from .sequences import _Prefill, _Seq, _request_of

log = logging.getLogger("kimi_jax.engine")

_TAIL_PIN = ("prefix-cache", "tail")  # allocator owner of a partial page while it is copied into or out of the cache


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
                    self._blocked_head = self._admission_inputs()
                    return  # not enough free slots or pages yet
                self._waiting.popleft()
                self._blocked_head = None
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
                if job.pos in job.checkpoints:
                    self._checkpoint_prefill(job)
            self._finish_prefill(job)

    def _admission_inputs(self) -> tuple:
        """What `_admit` of the waiting queue's head depends on: the head, free slots, free pages, the prefix cache's
        stores (a new hit, pages to evict) and the running sequences (each takes a page of headroom and holds pages
        eviction cannot free)."""
        return (self._waiting[0], len(self._free), self.alloc.free_blocks, self.prefix_cache.stores,
                len(self._running))

    def _head_still_blocked(self) -> bool:
        """Whether admitting the waiting queue's head failed and nothing has changed since in its favour (same head,
        no more free slots or pages, nothing stored in the prefix cache, no fewer running sequences): trying again
        would fail again."""
        blocked = self._blocked_head
        if blocked is None or not self._waiting:
            return False
        head, slots, pages, stores, running = blocked
        now_head, now_slots, now_pages, now_stores, now_running = self._admission_inputs()
        return (now_head is head and now_slots <= slots and now_pages <= pages and now_stores == stores
                and now_running >= running)

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
        """Start the prefill of a waiting request or preempted sequence, if slots and pages allow: resume from the
        deepest prefix-cache checkpoint on its ids (sharing the pages before it) and plan chunks for the rest."""
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
        match = self.prefix_cache.lookup(key, len(prefill_ids))
        chunks, checkpoints = self._plan(match.tokens, match.matched, len(prefill_ids))
        if match.tokens and req.images is not None and match.tokens + sum(chunks) < req.images.end:
            # chunk sizes that do not divide one another can leave a hit's remainder short of the last image
            # token; that token would then ride a decode step without its features -- prefill from scratch instead
            match = Match(matched=match.matched)
            chunks, checkpoints = self._plan(0, match.matched, len(prefill_ids))
        pos = match.tokens
        prefill_len = pos + sum(chunks)  # >= pos; the rest (< the smallest chunk) rides the decode steps
        bt = self.alloc.block_tokens
        # hold the hit's pages before making room, so that eviction cannot take them: the first sequence shares
        # the full ones; the partial one is pinned until it is copied
        self.alloc.share(keys[0], match.blocks)
        if match.tail_block is not None:
            self.alloc.share(_TAIL_PIN, [match.tail_block])
        # the prefill's own pages up front (the other n - 1 sequences share its full pages and get a copy of the last
        # partial one), plus one page of headroom per running sequence (so that admitting it does not immediately
        # force a preemption)
        full, partial = divmod(prefill_len, bt)
        need = (self.alloc.blocks_for_tokens(prefill_len) - len(match.blocks) + (n - 1) * (partial > 0)
                + len(self._running))
        while self.alloc.free_blocks < need and self.prefix_cache.evict_lru():
            pass
        if self.alloc.free_blocks < need:
            self.alloc.free(keys[0], missing_ok=True)
            self.alloc.free(_TAIL_PIN, missing_ok=True)
            return None
        self._orders += 1
        job = _Prefill(req, ids, item if isinstance(item, _Seq) else None, keys,
                       [self._free.pop() for _ in range(n)], self._orders, chunks, key, pos=pos,
                       prefill_len=prefill_len, checkpoints=checkpoints)
        self.alloc.allocate(keys[0], prefill_len)
        for k in keys[1:]:
            self.alloc.share(k, self.alloc.blocks(keys[0])[:full])
            self.alloc.allocate(k, prefill_len)
        if match.tail_block is not None:  # the partial page: this sequence writes on into a copy of its own
            self._state = self.runner.copy_blocks(self._state, [match.tail_block],
                                                  [self.alloc.blocks(keys[0])[pos // bt]])
            self.alloc.free(_TAIL_PIN)
        job.cache1 = self.runner.copy_cache1(match.checkpoint) if pos else self.runner.new_cache1()
        if job.seq is None:
            req.cached_tokens = pos
            self.prefix_query_tokens += len(req.prompt_ids)
            self.prefix_hit_tokens += pos
            self.prefix_hits += pos > 0
        self._prefilling = job
        return job

    def _plan(self, start: int, matched: int, limit: int) -> tuple[list, set]:
        """Chunk sizes for prompt positions ``start`` … ``limit`` (largest first, cut so that a chunk ends at each
        checkpoint position: every ``checkpoint_blocks`` pages and ``matched``, where the prompt leaves the cached
        pages), and the positions at which to take a checkpoint.  A position that only one-token chunks (or none)
        would reach exactly is skipped rather than slow the prefill down; what is left after the last chunk rides
        the decode steps."""
        if not self.prefix_cache.enabled:
            chunks, _ = self.runner.plan_chunks(limit - start)
            return chunks, set()
        every = self.prefix_cache.checkpoint_tokens
        points = set(range((start // every + 1) * every, limit, every))
        if start < matched < limit:
            points.add(matched)
        chunks, pos, taken = [], start, set()
        for p in sorted(points):
            seg, left = self.runner.plan_chunks(p - pos)
            if left or (1 in seg and min(self.runner.chunk_sizes) < max(self.runner.chunk_sizes)):
                continue
            chunks += seg
            pos = p
            taken.add(p)
        seg, _ = self.runner.plan_chunks(limit - pos)
        return chunks + seg, taken

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
            self._checkpoint_prefill(job)
            full, partial = divmod(job.prefill_len, self.alloc.block_tokens)
            src = self.alloc.blocks(job.keys[0])
            for k in job.keys[1:]:  # the others share the full pages; the partial one each writes on into a copy
                if partial:
                    self._state = self.runner.copy_blocks(self._state, [src[full]], [self.alloc.blocks(k)[full]])
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

    def _checkpoint_prefill(self, job: _Prefill) -> None:
        """A prefix-cache checkpoint of the prefill in progress at ``job.pos`` (its pages before that; part-way into a
        page, a copy of that page, which the sequence keeps writing -- skipped when no page is free)."""
        t, cache = job.pos, self.prefix_cache
        if t <= 0 or cache.has_checkpoint(job.key, t):
            return
        blocks = self.alloc.blocks(job.keys[0])
        tail = None
        if t % self.alloc.block_tokens:
            if self.alloc.free_blocks == 0:
                return
            tail = self.alloc.allocate(_TAIL_PIN, 1)[0]
            self._state = self.runner.copy_blocks(self._state, [blocks[t // self.alloc.block_tokens]], [tail])
        cache.store(job.key, t, blocks, self.runner.copy_cache1(job.cache1), tail)
        self.alloc.free(_TAIL_PIN, missing_ok=True)

    def _checkpoint_sequence(self, seq: _Seq) -> None:
        """A prefix-cache checkpoint of a running sequence after its last fed token, with its pages (its partial last
        page as it is: call this only when the sequence is about to let its pages go). A step in flight that feeds
        its next token (`_fed_ahead`, overlap.py) has written that token too: the state read here is after it."""
        t, cache = seq.fed + (self._fed_ahead.get(seq.slot) is seq), self.prefix_cache
        if not cache.enabled or t <= 0 or seq.slot is None or self._running.get(seq.slot) is not seq:
            return
        req = seq.req
        ids = req.prompt_ids + seq.output_ids
        if t > len(ids):
            return  # a stop inside a verify step's accepted drafts: the cache holds drafts past the last output
        key = req.images.cache_key(ids) if req.images is not None else ids
        if cache.has_checkpoint(key, t):
            return
        blocks = self.alloc.blocks(seq.key)
        bt = self.alloc.block_tokens
        cache.store(key, t, blocks, self.runner.take_cache1(self._state, seq.slot),
                    blocks[t // bt] if t % bt else None)

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
        self._checkpoint_sequence(seq)  # its pages stay cached: the recompute resumes here unless they are evicted
        del self._running[seq.slot]
        self._free.append(seq.slot)
        self.alloc.free(seq.key, missing_ok=True)
        seq.slot, seq.pending, seq.fed = None, deque(), 0
        seq.preemptions += 1
        self._waiting.appendleft(seq)
        log.info("preempted sequence %s of request %s after %d tokens (out of cache pages)", seq.index,
                 seq.req.request_id, len(seq.req.prompt_ids) + len(seq.output_ids))
