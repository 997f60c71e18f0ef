"""Prefix caching: reuse the inference state of a prompt prefix that was prefilled before.

The seam (``Engine._start_prefill`` / ``Engine._finish_prefill``):

    hit = prefix_cache.lookup(prefill_ids)      # -> (n_tokens, batch-1 cache of exactly those tokens) or None
    ... prefill the remaining prefill_ids[n_tokens:] in chunks from that state ...
    prefix_cache.store(prefill_ids, cache1)     # a snapshot after the chunked part of the prompt

Why snapshots, not pages: KDA layers carry a recurrent state (SPEC §4), so the state after token t cannot be
assembled from per-token pages -- a reusable prefix needs the whole state at exactly that token.  MLA layers could
share pages; with the current contiguous ``[B, max_len, ·]`` cache a snapshot costs a full batch-1 cache, so this
LRU is off by default (``prefix_cache_entries=0``) and meant for small models, tests and repeated prompts (``n > 1``
already shares one prefill without it).  A paged MLA cache plus KDA state snapshots at chunk boundaries is the
planned production design; it replaces this class behind the same two calls.

``lookup`` returns the longest stored key that is a prefix of the query; the caller gets a private copy (the engine
donates prefill caches, and stored snapshots must survive that).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Optional, Sequence


class PrefixCache:
    def __init__(self, capacity: int, copy_fn: Callable):
        self.capacity = int(capacity)
        self._copy = copy_fn
        self._entries: "OrderedDict[tuple[int, ...], object]" = OrderedDict()
        self.hits = 0
        self.queries = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, ids: Sequence[int]) -> Optional[tuple[int, object]]:
        if self.capacity <= 0 or not ids:
            return None
        self.queries += 1
        key = tuple(ids)
        best = None
        for k in self._entries:
            if len(k) <= len(key) and (best is None or len(k) > len(best)) and key[: len(k)] == k:
                best = k
        if best is None:
            return None
        self._entries.move_to_end(best)
        self.hits += 1
        return len(best), self._copy(self._entries[best])

    def store(self, ids: Sequence[int], cache1) -> None:
        if self.capacity <= 0 or not ids:
            return
        key = tuple(ids)
        self._entries[key] = cache1
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()
