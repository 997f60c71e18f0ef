"""Prefix caching: MLA pages shared between sequences through a tree of page-sized token blocks, and KDA checkpoints.

An MLA page holds the latent rows (and index keys) of ``block_tokens`` positions; those rows depend only on the
tokens up to them, so any sequence whose ids start with the same blocks can read the same pages.  The cache is a
tree keyed by whole blocks of ids (a radix tree whose edges are one page each, as sglang's radix cache; vLLM chains
block hashes to the same end): a node is one full page, held in the ``BlockAllocator`` under the cache's own owner
id, and shared read-only with every sequence that starts with its path (reference counts: a page is free once
neither the cache nor any sequence holds it).  Pages are never written once full, so sharing needs no copy.

KDA layers carry a recurrent state (docs/model.md §4): the state after token t cannot be assembled from pages, so a
prefix is reusable only up to a **checkpoint**, the batch-1 KDA state (and conv tails, and length) after exactly
that many tokens.  A checkpoint sits on a node (after its page's last token) or on a **tail**: a position part-way
into a page, with a private copy of that partial page (the sequence that left it keeps writing its own).  A lookup
walks the tree along the query's blocks and returns the deepest checkpoint on the way (a node's, or a tail whose ids
continue the query); the caller shares the path's pages, copies the tail page if any, copies the checkpoint (the
prefill donates it) and prefills only the rest.  It also returns how far full pages matched beyond that checkpoint:
the engine takes a checkpoint there as it prefills, so the next prompt that shares that much resumes at it.

Where checkpoints come from (``scheduler.py``): every ``checkpoint_blocks`` pages of a prefill and where a prefill
leaves the cached pages, the end of every prefill, and the last token of a sequence that finishes or is preempted (a
conversation's next turn, or the recompute, resumes there).  Their count is capped (``max_checkpoints``, least
recently used dropped first); a leaf page without a checkpoint at or below it can never be resumed from and goes
at once.

Eviction (``evict_lru``): the least recently used leaf page or tail that no sequence holds, which frees its page;
the engine evicts before it refuses an admission or preempts a running sequence.  The cache itself never touches a
device: checkpoints are opaque values the engine makes and copies.

Keys are the ids as the engine keys a prompt: ``(image digest, index)`` items stand in for image tokens
(``images.PromptImages.cache_key``), so equal ids with different images part at the first image token.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence


# the default cap on checkpoints is max_num_seqs, but at least this many: a server of one or two slots (a notebook, a
# single user) still keeps a few conversations and their shared prompts
MIN_DEFAULT_CHECKPOINTS = 8


def checkpoint_interval(state_bytes: int, block_bytes: int, most: int) -> int:
    """Pages between a prefill's checkpoints, chosen by memory cost: the smallest power of two N for which a
    checkpoint (one sequence's KDA state, ``state_bytes``) costs no more than the N pages it lets a prompt skip
    (``block_bytes`` each, every MLA layer and DCP rank together), at most ``most`` (a sequence's pages: a model
    without MLA layers has pages of no bytes, and then checkpoints only where prompts part and prefills end)."""
    n = 1
    while n < most and n * block_bytes < state_bytes:
        n *= 2
    return min(n, most)


@dataclass(frozen=True)
class Match:
    """What ``PrefixCache.lookup`` found for a query.

    tokens: positions served (0: no checkpoint on the query's path); the sequence resumes at this position.
    blocks: the shared pages of its first ``tokens // block_tokens`` blocks.
    tail_block: the page holding positions ``[tokens // block_tokens · block_tokens, tokens)`` when ``tokens`` is not
        a whole number of blocks (copy it into a page of the sequence's own), else None.
    checkpoint: the batch-1 KDA state after exactly ``tokens`` tokens (None when ``tokens`` is 0).
    matched: positions covered by full cached pages along the query (>= tokens rounded down to a block).
    """

    tokens: int = 0
    blocks: tuple = ()
    tail_block: Optional[int] = None
    checkpoint: object = None
    matched: int = 0


class _Node:
    """One full page of a cached prefix (the root holds none)."""

    __slots__ = ("key", "block", "parent", "children", "tails", "checkpoint", "used", "owner", "alive")

    def __init__(self, key, block, parent, owner):
        self.key, self.block, self.parent, self.owner = key, block, parent, owner
        self.children: dict = {}
        self.tails: dict = {}
        self.checkpoint = None
        self.used = 0
        self.alive = True

    @property
    def leaf(self) -> bool:
        return not self.children and not self.tails


class _Tail:
    """A checkpoint part-way into the page after ``parent``: its ids, its KDA state and a private copy of the page."""

    __slots__ = ("key", "block", "parent", "checkpoint", "used", "owner", "alive")

    def __init__(self, key, block, parent, checkpoint, owner):
        self.key, self.block, self.parent, self.checkpoint, self.owner = key, block, parent, checkpoint, owner
        self.used = 0
        self.alive = True


class PrefixCache:
    """The tree of cached pages and checkpoints over one ``BlockAllocator`` (see the module docstring).

    ``enabled=False`` makes every lookup empty and every store a no-op.  ``max_checkpoints`` >= 1 caps the KDA
    checkpoints held (each is one sequence's KDA state); ``checkpoint_blocks`` is the engine's policy (a checkpoint
    every that many pages of a prefill), kept here so that both read one number.
    """

    def __init__(self, alloc, *, enabled: bool = True, max_checkpoints: int = 32, checkpoint_blocks: int = 1):
        if enabled and max_checkpoints < 1:
            raise ValueError(f"prefix caching needs room for at least 1 checkpoint, got {max_checkpoints}")
        if checkpoint_blocks < 1:
            raise ValueError(f"checkpoint_blocks must be >= 1, got {checkpoint_blocks}")
        self.alloc = alloc
        self.enabled = bool(enabled)
        self.block_tokens = alloc.block_tokens
        self.max_checkpoints = int(max_checkpoints)
        self.checkpoint_blocks = int(checkpoint_blocks)
        self._root = _Node((), None, None, None)
        self._owners = itertools.count()
        self._clock = 0
        self._heap: list = []  # (used, n, item): eviction candidates, checked when popped (lazy deletion)
        self._ticket = itertools.count()
        self._checkpoints: "OrderedDict[object, None]" = OrderedDict()  # items holding one, least recent first
        self._items = 0  # live nodes and tails
        self.stores = 0  # calls of `store` that cached something: each may give a prompt a hit or free a page to evict

    # ------------------------------------------------------------------------------------------------ queries
    @property
    def checkpoint_tokens(self) -> int:
        return self.checkpoint_blocks * self.block_tokens

    def __len__(self) -> int:
        """Checkpoints held."""
        return len(self._checkpoints)

    def lookup(self, key: Sequence, limit: int) -> Match:
        """The deepest checkpoint at or before ``limit`` tokens along ``key`` (and the pages before it); marks what
        it returns as recently used."""
        if not self.enabled or limit <= 0:
            return Match()
        bt = self.block_tokens
        node, t, best, path = self._root, 0, None, []
        while True:
            for tail in node.tails.values():
                r = len(tail.key)
                if t + r <= limit and (best is None or t + r > best[0]) and tuple(key[t:t + r]) == tail.key:
                    best = (t + r, len(path), tail)
            if t + bt > limit:
                break
            child = node.children.get(tuple(key[t:t + bt]))
            if child is None:
                break
            node, t = child, t + bt
            path.append(node)
            if node.checkpoint is not None and (best is None or t > best[0]):
                best = (t, len(path), node)
        if best is None:
            return Match(matched=t)
        tokens, depth, item = best
        for n in path[:depth]:
            self._touch(n)
        self._touch(item, checkpoint=True)
        tail = item if isinstance(item, _Tail) else None
        return Match(tokens, tuple(n.block for n in path[:depth]), None if tail is None else tail.block,
                     item.checkpoint, t)

    def has_checkpoint(self, key: Sequence, tokens: int) -> bool:
        """Whether a checkpoint after exactly the first ``tokens`` ids of ``key`` is held (or caching is off)."""
        if not self.enabled:
            return True
        bt = self.block_tokens
        node = self._root
        for i in range(tokens // bt):
            node = node.children.get(tuple(key[i * bt:(i + 1) * bt]))
            if node is None:
                return False
        r = tokens % bt
        if r == 0:
            return node.checkpoint is not None
        return tuple(key[tokens - r:tokens]) in node.tails

    # ------------------------------------------------------------------------------------------------ updates
    def store(self, key: Sequence, tokens: int, blocks: Sequence[int], checkpoint, tail_block: Optional[int] = None):
        """Cache the first ``tokens`` ids of ``key``: its full pages ``blocks[: tokens // block_tokens]`` (held by the
        caller; the cache takes its own hold on those it does not have yet) and ``checkpoint``, the KDA state after
        exactly those tokens.  When ``tokens`` is not a whole number of blocks, ``tail_block`` is a page holding the
        last partial block that nobody will write again (a copy, or the page of a sequence that ends); the cache
        holds it too.  A checkpoint already held at that position is kept and ``checkpoint`` dropped."""
        if not self.enabled or tokens <= 0:
            return
        self.stores += 1
        if len(key) < tokens or len(blocks) < -(-tokens // self.block_tokens) - (tail_block is not None):
            raise ValueError(f"store({tokens} tokens) needs that many ids ({len(key)} given) and their full pages "
                             f"({len(blocks)} given)")
        bt = self.block_tokens
        node = self._root
        for i in range(tokens // bt):
            k = tuple(key[i * bt:(i + 1) * bt])
            child = node.children.get(k)
            if child is None:
                child = _Node(k, int(blocks[i]), node, ("prefix-cache", next(self._owners)))
                self.alloc.share(child.owner, [child.block])
                node.children[k] = child
                self._items += 1
            self._touch(child)
            node = child
        r = tokens % bt
        if r == 0:
            if node.checkpoint is None:
                node.checkpoint = checkpoint
                self._checkpoints[node] = None
            self._touch(node, checkpoint=True)
        else:
            if tail_block is None:
                raise ValueError(f"{tokens} tokens end part-way into a page: store needs the page (tail_block)")
            k = tuple(key[tokens - r:tokens])
            tail = node.tails.get(k)
            if tail is None:
                tail = _Tail(k, int(tail_block), node, checkpoint, ("prefix-cache", next(self._owners)))
                self.alloc.share(tail.owner, [tail.block])
                node.tails[k] = tail
                self._checkpoints[tail] = None
                self._items += 1
            self._touch(tail, checkpoint=True)
        while len(self._checkpoints) > self.max_checkpoints:
            self._drop_checkpoint(next(iter(self._checkpoints)))

    def evict_lru(self) -> bool:
        """Free at least one page: drop the least recently used leaf page or tail that no sequence holds (with its
        checkpoint).  False when nothing cached can free a page."""
        aside, freed = [], False
        while self._heap and not freed:
            entry = heapq.heappop(self._heap)
            used, _, item = entry
            if not item.alive or item.used != used or (isinstance(item, _Node) and not item.leaf):
                continue  # stale: used since, gone, or no longer a leaf (pushed again when it becomes one)
            if self.alloc.ref_count(item.block) > 1:
                aside.append(entry)  # a sequence reads it: dropping it would free nothing
                continue
            self._remove(item)
            freed = True
        for entry in aside:
            heapq.heappush(self._heap, entry)
        return freed

    def stats(self) -> dict:
        """pages: held by the cache; reclaimable: of those, read by no sequence (what eviction can free)."""
        pages = reclaimable = 0
        stack = [self._root]
        while stack:
            node = stack.pop()
            items = list(node.children.values()) + list(node.tails.values())
            for item in items:
                pages += 1
                reclaimable += self.alloc.ref_count(item.block) == 1
            stack.extend(node.children.values())
        return {"pages": pages, "reclaimable_pages": reclaimable, "checkpoints": len(self._checkpoints)}

    # ------------------------------------------------------------------------------------------------ internals
    def _touch(self, item, checkpoint: bool = False) -> None:
        """Mark a page (or tail) used now; ``checkpoint``: its checkpoint too (it was stored or resumed from -- the
        checkpoints of pages a prompt merely passes through keep their age)."""
        self._clock += 1
        item.used = self._clock
        if checkpoint and item in self._checkpoints:
            self._checkpoints.move_to_end(item)
        if isinstance(item, _Tail) or item.leaf:
            self._push(item)

    def _push(self, item) -> None:
        heapq.heappush(self._heap, (item.used, next(self._ticket), item))
        if len(self._heap) > 4 * self._items + 1024:  # mostly stale entries: rebuild from the live candidates
            self._heap = [e for e in self._heap if e[2].alive and e[2].used == e[0]]
            heapq.heapify(self._heap)

    def _drop_checkpoint(self, item) -> None:
        del self._checkpoints[item]
        if isinstance(item, _Tail):
            self._remove(item)
            return
        item.checkpoint = None
        if item.leaf:
            self._remove(item)

    def _remove(self, item) -> None:
        """Take a tail or a leaf node out (its checkpoint, the cache's hold on its page); then its parent, if that is
        now a leaf with no checkpoint (nothing could resume below it)."""
        parent = item.parent
        if isinstance(item, _Tail):
            del parent.tails[item.key]
        else:
            del parent.children[item.key]
        self._checkpoints.pop(item, None)
        self.alloc.free(item.owner)
        item.alive, item.checkpoint = False, None
        self._items -= 1
        if parent is self._root or not parent.leaf:
            return
        if parent.checkpoint is None:
            self._remove(parent)
        else:
            self._push(parent)  # a leaf now: a candidate for eviction at its own last use
