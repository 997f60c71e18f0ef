"""Prefix caching: reuse the inference state of a prompt prefix that was prefilled before.

The seam (``Engine._admit`` / ``Engine._finish_prefill``, ``scheduler.py``):

    hit = prefix_cache.lookup(prefill_ids)      # -> (n_tokens, batch-1 cache of exactly those tokens) or None
    ... prefill the remaining prefill_ids[n_tokens:] in chunks from that state ...
    prefix_cache.store(prefill_ids, cache1)     # a snapshot after the chunked part of the prompt

Why snapshots, not pages alone: KDA layers carry a recurrent state (docs/model.md §4), so the state after token t
cannot be assembled from per-token pages -- a reusable prefix needs the whole state at exactly that token.  An entry
is the sequence's KDA snapshot plus private copies of its MLA pages (the engine allocates them under the entry's own
allocator id and copies the pages in; a hit copies them out into the new sequence's pages).  Entries hold pool blocks,
so the engine evicts them (``evict_lru``; ``on_evict`` frees the blocks) before it preempts a running sequence.  Off
by default (``prefix_cache_entries=0``); ``n > 1`` already shares one prefill without it.

``lookup`` returns the longest stored key that is a prefix of the query; the caller gets a private copy (the engine
donates prefill caches, and stored snapshots must survive that).  Keys are the prompt ids, except that the engine
puts ``(image digest, index)`` items in place of image tokens (``images.PromptImages.cache_key``): equal ids with
different images are different keys from the first image token on.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Optional, Sequence


class PrefixCache:
    def __init__(self, capacity: int, copy_fn: Callable, on_evict: Optional[Callable] = None):
        self.capacity = int(capacity)
        self._copy = copy_fn
        self._on_evict = on_evict
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
        if key in self._entries:
            self._evict(key)
        self._entries[key] = cache1
        while len(self._entries) > self.capacity:
            self.evict_lru()

    def evict_lru(self) -> bool:
        """Drop the least recently used entry; False when empty."""
        if not self._entries:
            return False
        self._evict(next(iter(self._entries)))
        return True

    def _evict(self, key) -> None:
        value = self._entries.pop(key)
        if self._on_evict is not None:
            self._on_evict(value)

    def clear(self) -> None:
        while self.evict_lru():
            pass
