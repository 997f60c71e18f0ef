"""Paged MLA cache (docs/model.md §10): pages of PAGE_TOKENS (64) tokens, one pool per MLA layer, block tables per
sequence.

Pieces
- `PagedCacheSpec` — the allocation plan: formats, pool size, and every byte figure, all read from
  `kimi_jax.cache.CacheLayout` (bytes per token / per page / per sequence; no second formula). The storage formats of
  `kimi_jax.quant` are checked against those figures when the spec is built.
- `LayerPool` — one MLA layer's arrays: each latent / index-key part `[num_blocks, 64, width]` and the layer's
  float32 latent scale (see `kimi_jax.quant`; 1.0 unless calibrated). A pytree; update it functionally (donate it
  under jit). The spec's array methods are jitted with the spec static (it is hashable).
- `BlockAllocator` — host-side page bookkeeping for the serving engine: allocate / free / stats, one block list
  per sequence, a clear `OutOfBlocksError` (nothing is allocated when a request cannot be met).
- `BlockTable` — the decode step's `[rows, max_blocks]` table, kept across steps and rewritten only where a row's
  pages changed (a step at long context otherwise copies every row's whole page list).
- write path: `write` (B sequences, T new tokens each, quantised on write) and `append` (one sequence);
  gather path: `gather_latent` / `gather_index_keys` (dequantised rows for given positions) and the raw
  `gather_parts` / `gather_pages` (stored form, no dequantisation) the ops in `pallas_kernels` build on.

Block 0 of every pool is the NULL block: the allocator never hands it out, block tables are padded with it, so a
padded table entry always names a real page whose contents are never attended (positions past a sequence's length
are masked by the ops). Writes with no valid slot (padding rows, positions past the table or on a null-block entry)
are dropped, so the null block stays all zeros.
Position p of a sequence lives in block `table[p // 64]`, slot `p % 64`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.paged import flat_slots, gather_pages, gather_parts

from .cache import PAGE_TOKENS, CacheLayout
from .config import ModelConfig
from .quant import IndexKeyFormat, LatentFormat, check_against_cache

NULL_BLOCK = 0


class OutOfBlocksError(RuntimeError):
    """The pool has too few free pages for a request."""


class LayerPool(NamedTuple):
    latent: tuple  # parts of LatentFormat, each [num_blocks, PAGE_TOKENS, width]
    index: tuple  # parts of IndexKeyFormat (empty without an indexer)
    latent_scale: jax.Array  # float32 scalar: the per-layer scale of the fp8 / nvfp4 latent


@dataclass(frozen=True)
class PagedCacheSpec:
    """The allocation plan of the paged MLA cache for one model and one pair of storage formats."""

    layout: CacheLayout
    num_blocks: int  # pages per layer pool, the NULL block included

    def __post_init__(self):
        if self.num_blocks < 2:
            raise ValueError(f"a paged cache needs at least 2 blocks (block {NULL_BLOCK} is the null block), "
                             f"got {self.num_blocks}")
        check_against_cache(self.latent_format)
        if self.index_format is not None:
            check_against_cache(self.index_format)
        parts = sum(p.bytes_per_token for p in self.latent_format.parts)
        if self.index_format is not None:
            parts += sum(p.bytes_per_token for p in self.index_format.parts)
        if parts != self.layout.layer_bytes_per_token:
            raise AssertionError(f"pool parts hold {parts} B/token/layer, CacheLayout says "
                                 f"{self.layout.layer_bytes_per_token}")

    @classmethod
    def create(cls, config: ModelConfig, *, num_blocks: int, kv_dtype: str = "fp8",
               index_dtype: str = "fp8") -> "PagedCacheSpec":
        return cls(CacheLayout(config, kv_dtype=kv_dtype, index_dtype=index_dtype), num_blocks)

    @classmethod
    def for_budget(cls, config: ModelConfig, budget_bytes: int, *, kv_dtype: str = "fp8",
                   index_dtype: str = "fp8") -> "PagedCacheSpec":
        """As many pages as fit in `budget_bytes` of cache memory (all MLA layers together)."""
        layout = CacheLayout(config, kv_dtype=kv_dtype, index_dtype=index_dtype)
        n = int(budget_bytes // layout.page_bytes)
        if n < 2:
            raise ValueError(f"{budget_bytes} B holds {n} pages of {layout.page_bytes} B; need at least 2")
        return cls(layout, n)

    # ---- formats
    @property
    def config(self) -> ModelConfig:
        return self.layout.config

    @property
    def latent_format(self) -> LatentFormat:
        m = self.config.mla
        return LatentFormat(self.layout.kv_dtype, m.kv_lora_rank, m.qk_rope_head_dim)

    @property
    def index_format(self) -> Optional[IndexKeyFormat]:
        ix = self.config.indexer
        return None if ix is None else IndexKeyFormat(self.layout.index_dtype, ix.head_dim)

    @property
    def num_layers(self) -> int:
        return len(self.config.mla_layers)

    # ---- byte figures (all from CacheLayout)
    @property
    def bytes_per_token(self) -> int:
        """One token in every MLA layer."""
        return self.layout.kv_bytes_per_token

    @property
    def bytes_per_token_layer(self) -> int:
        return self.layout.layer_bytes_per_token

    @property
    def block_bytes(self) -> int:
        """One page in every MLA layer."""
        return self.layout.page_bytes

    @property
    def pool_bytes(self) -> int:
        """All pools (every MLA layer), the null block included; the latent scales (4 B per layer) aside."""
        return self.num_blocks * self.layout.page_bytes

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def max_tokens(self) -> int:
        return self.usable_blocks * PAGE_TOKENS

    def blocks_for_tokens(self, tokens: int) -> int:
        return self.layout.blocks_for_tokens(tokens)

    def sequence_bytes(self, tokens: int) -> int:
        """Pages + fixed KDA state of one sequence of `tokens` tokens."""
        return self.layout.sequence_bytes(tokens)

    def summary(self, tokens_per_sequence: Optional[int] = None) -> dict:
        d = {
            "kv_dtype": self.layout.kv_dtype, "index_dtype": self.layout.index_dtype if self.index_format else None,
            "page_tokens": PAGE_TOKENS, "num_blocks": self.num_blocks, "mla_layers": self.num_layers,
            "latent_bytes_per_token_layer": self.layout.latent_bytes_per_token_layer,
            "index_bytes_per_token_layer": self.layout.index_bytes_per_token_layer,
            "kv_bytes_per_token": self.bytes_per_token, "block_bytes": self.block_bytes,
            "pool_bytes": self.pool_bytes, "max_cached_tokens": self.max_tokens,
            "state_bytes_per_sequence": self.layout.state_bytes_per_sequence,
        }
        if tokens_per_sequence is not None:
            d["sequence_bytes"] = self.sequence_bytes(tokens_per_sequence)
            d["max_sequences"] = self.usable_blocks // max(1, self.blocks_for_tokens(tokens_per_sequence))
        return d

    # ---- arrays
    def init_layer(self, latent_scale: float = 1.0, ranks: int = 1) -> LayerPool:
        """One layer's zeroed pool; `ranks` > 1 (decode context parallelism): the pools of that many ranks stacked,
        parts `[ranks · num_blocks, 64, w]`, to be split on dim 0 over the DCP axis."""
        def zeros(fmt):
            if fmt is None:
                return ()
            return tuple(jnp.zeros((ranks * self.num_blocks, PAGE_TOKENS, p.width), p.dtype) for p in fmt.parts)

        return LayerPool(zeros(self.latent_format), zeros(self.index_format), jnp.float32(latent_scale))

    def init(self, latent_scales=None, ranks: int = 1) -> tuple[LayerPool, ...]:
        """One pool per MLA layer (`ranks` as `init_layer`)."""
        scales = [1.0] * self.num_layers if latent_scales is None else list(latent_scales)
        if len(scales) != self.num_layers:
            raise ValueError(f"need {self.num_layers} latent scales, got {len(scales)}")
        return tuple(self.init_layer(s, ranks) for s in scales)

    # ---- write path
    @partial(jax.jit, static_argnums=0)
    def write(self, pool: LayerPool, block_tables, starts, rows_btc, keys_btd=None, lengths=None) -> LayerPool:
        """Quantise and store T new tokens for each of B sequences.

        block_tables `[B, max_blocks]` int32, starts `[B]` (position of the first new token), rows `[B, T, R+rope]`,
        keys `[B, T, d]` (required with an indexer), lengths `[B]` (how many of the T tokens are real; default T).
        Pages for positions up to start + length − 1 must already be in the table (rows that land on a padded /
        null entry are dropped). Returns the updated pool.
        """
        rows_btc = jnp.asarray(rows_btc)
        B, T, _ = rows_btc.shape
        slots = self._slots(block_tables, starts, T, lengths)
        latent = _scatter(pool.latent, self.latent_format.quantize(rows_btc, pool.latent_scale), slots)
        index = pool.index
        if self.index_format is not None:
            if keys_btd is None:
                raise ValueError("this model has an indexer: write() needs the index keys")
            index = _scatter(pool.index, self.index_format.quantize(keys_btd), slots)
        return LayerPool(latent, index, pool.latent_scale)

    def append(self, pool: LayerPool, block_table, start, rows_tc, keys_td=None) -> LayerPool:
        """One sequence: store T tokens at positions start…start+T−1 (block_table `[max_blocks]`)."""
        keys = None if keys_td is None else jnp.asarray(keys_td)[None]
        return self.write(pool, jnp.asarray(block_table)[None], jnp.reshape(jnp.asarray(start), (1,)),
                          jnp.asarray(rows_tc)[None], keys)

    def _slots(self, block_tables, starts, T, lengths):
        block_tables = jnp.asarray(block_tables, jnp.int32)
        B, nb = block_tables.shape
        pos = jnp.asarray(starts, jnp.int32).reshape(B, 1) + jnp.arange(T, dtype=jnp.int32)[None]
        ok = jnp.ones((B, T), bool) if lengths is None else jnp.arange(T)[None] < jnp.asarray(lengths).reshape(B, 1)
        ok &= (pos >= 0) & (pos < nb * PAGE_TOKENS)
        slot = flat_slots(block_tables, pos, PAGE_TOKENS)
        ok &= slot // PAGE_TOKENS != NULL_BLOCK  # a padded table entry: never write the null block
        return jnp.where(ok, slot, self.num_blocks * PAGE_TOKENS)  # out of bounds: dropped by the scatter

    # ---- gather path
    @partial(jax.jit, static_argnums=0)
    def gather_latent(self, pool: LayerPool, block_tables, positions):
        """Dequantised latent rows float32 `[B, ..., R+rope]` at `positions` `[B, ...]`; zeros where position < 0."""
        parts = gather_parts(pool.latent, block_tables, positions)
        rows = self.latent_format.dequantize(parts, pool.latent_scale)
        return jnp.where((jnp.asarray(positions) >= 0)[..., None], rows, 0.0)

    @partial(jax.jit, static_argnums=0)
    def gather_index_keys(self, pool: LayerPool, block_tables):
        """Dequantised index keys float32 `[B, max_blocks·64, d]`: position s of each sequence at row s."""
        if self.index_format is None:
            raise ValueError("this model has no indexer")
        return self.index_format.dequantize(gather_pages(pool.index, block_tables))


def _scatter(parts, values, slots):
    out = []
    for p, v in zip(parts, values):
        flat = p.reshape((-1, p.shape[-1]))
        flat = flat.at[slots.reshape(-1)].set(v.reshape((-1, v.shape[-1])).astype(p.dtype), mode="drop")
        out.append(flat.reshape(p.shape))
    return tuple(out)


class BlockAllocator:
    """Host-side page allocator shared by every MLA layer (a sequence gets the same block ids in each layer's pool).

    `allocate(owner, total_tokens)` grows an owner's block list to cover `total_tokens` tokens and returns the new
    block ids; `share(owner, blocks)` appends pages another owner already holds (a cached prefix: the page is then
    read by both and written by neither); `free(owner)` drops the owner's hold on each of its pages, and a page goes
    back to the pool when no owner holds it any more (reference counts); `block_table(owners, max_blocks)` builds
    the padded int32 table. Block 0 (the null block) is never handed out. Allocation is all-or-nothing.
    """

    def __init__(self, num_blocks: int, block_tokens: int = PAGE_TOKENS):
        """`block_tokens`: sequence positions one table entry covers — PAGE_TOKENS, or PAGE_TOKENS · N under decode
        context parallelism over N ranks (each rank's page of that id holds every N-th of those positions)."""
        if num_blocks < 2:
            raise ValueError(f"need at least 2 blocks (block {NULL_BLOCK} is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_tokens = int(block_tokens)
        self._free = list(range(num_blocks - 1, 0, -1))  # pop() hands out low ids first
        self._refs = [0] * num_blocks  # owners holding each page
        self._blocks: dict = {}
        self._tokens: dict = {}

    @classmethod
    def for_spec(cls, spec: PagedCacheSpec) -> "BlockAllocator":
        return cls(spec.num_blocks)

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def blocks(self, seq_id) -> list:
        return list(self._blocks.get(seq_id, ()))

    def held(self, seq_id) -> Sequence[int]:
        """`seq_id`'s live page list, not a copy: read it, never change it. It only grows (`allocate`, `share`)
        until `free`, after which the owner's next pages start a new list -- so a reader that kept the list object
        can tell "the same pages and maybe more" (`is`) from "other pages"."""
        return self._blocks.get(seq_id, ())

    def tokens(self, seq_id) -> int:
        return self._tokens.get(seq_id, 0)

    def ref_count(self, block: int) -> int:
        """How many owners hold page `block` (0: it is free)."""
        return self._refs[block]

    def can_allocate(self, seq_id, total_tokens: int) -> bool:
        return self._needed(seq_id, total_tokens) <= len(self._free)

    def _needed(self, seq_id, total_tokens: int) -> int:
        if total_tokens < 0:
            raise ValueError(f"token count must be >= 0, got {total_tokens}")
        return max(0, self.blocks_for_tokens(total_tokens) - len(self._blocks.get(seq_id, ())))

    def blocks_for_tokens(self, tokens: int) -> int:
        """Table entries a sequence of `tokens` positions needs."""
        return -(-int(tokens) // self.block_tokens)

    def allocate(self, seq_id, total_tokens: int) -> list:
        """Make `seq_id` hold pages for `total_tokens` tokens (its whole length so far, not the increment)."""
        need = self._needed(seq_id, total_tokens)
        if need > len(self._free):
            have = len(self._blocks.get(seq_id, ()))
            raise OutOfBlocksError(
                f"out of cache blocks: sequence {seq_id!r} needs {need} more block(s) of {self.block_tokens} tokens "
                f"to hold {total_tokens} tokens (it has {have}), but only {len(self._free)} of "
                f"{self.num_blocks - 1} are free; free finished sequences or allocate a larger pool")
        new = [self._free.pop() for _ in range(need)]
        for b in new:
            self._refs[b] = 1
        self._blocks.setdefault(seq_id, []).extend(new)
        self._tokens[seq_id] = max(self._tokens.get(seq_id, 0), total_tokens)
        return new

    def share(self, seq_id, blocks) -> None:
        """Append `blocks`, pages some owner holds already, to `seq_id`'s list (their holders go up by one)."""
        blocks = [int(b) for b in blocks]
        for b in blocks:
            if b == NULL_BLOCK or self._refs[b] == 0:
                raise ValueError(f"block {b} is not held by any owner: only held pages can be shared")
        for b in blocks:
            self._refs[b] += 1
        have = self._blocks.setdefault(seq_id, [])
        have.extend(blocks)
        self._tokens[seq_id] = max(self._tokens.get(seq_id, 0), len(have) * self.block_tokens)

    def holds(self, seq_id) -> bool:
        return seq_id in self._blocks

    def free(self, seq_id, missing_ok: bool = False) -> int:
        """Drop `seq_id`'s hold on every page it has; returns how many pages went back to the pool (those no other
        owner holds). Unknown ids raise KeyError (or free 0 with `missing_ok`)."""
        if seq_id not in self._blocks:
            if missing_ok:
                return 0
            raise KeyError(f"sequence {seq_id!r} holds no cache blocks")
        blocks = self._blocks.pop(seq_id)
        self._tokens.pop(seq_id, None)
        freed = 0
        for b in reversed(blocks):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)
                freed += 1
        return freed

    def block_table(self, seq_ids, max_blocks: Optional[int] = None) -> np.ndarray:
        """int32 `[len(seq_ids), max_blocks]`, padded with the null block."""
        lists = [self._blocks.get(s, []) for s in seq_ids]
        width = max([len(b) for b in lists] + [1]) if max_blocks is None else max_blocks
        table = np.full((len(lists), width), NULL_BLOCK, np.int32)
        for i, b in enumerate(lists):
            if len(b) > width:
                raise ValueError(f"sequence {seq_ids[i]!r} holds {len(b)} blocks, more than max_blocks={width}")
            table[i, : len(b)] = b
        return table

    def stats(self) -> dict:
        used = self.num_blocks - 1 - len(self._free)
        return {"total_blocks": self.num_blocks - 1, "used_blocks": used, "free_blocks": len(self._free),
                "sequences": len(self._blocks), "cached_tokens": sum(self._tokens.values()),
                "capacity_tokens": used * self.block_tokens, "page_tokens": self.block_tokens}


class BlockTable:
    """A block table ``[rows, max_blocks]`` int32 (row r: the pages of the sequence in slot r, padded with the null
    block) kept on the host across decode steps.

    `update` rewrites only what changed since the last call: a row whose page list (`BlockAllocator.held`) is the same
    list object gets its new tail, a row whose sequence changed is rewritten, a row nobody holds any more goes back
    to the null block. A step at 1M tokens of context otherwise copies 16,384 entries per row.

    The array is updated in place unless `update` is told the current one is still lent to a step in flight (JAX
    may read a NumPy argument in place, after the call has returned): then a change goes to a fresh copy.
    """

    def __init__(self, rows: int, max_blocks: int):
        self.array = np.full((rows, max_blocks), NULL_BLOCK, np.int32)
        self._written: dict = {}  # row -> (the page list the row mirrors, entries written)

    def update(self, pages_by_row: dict, lent: bool = False) -> np.ndarray:
        """``pages_by_row``: {row: that row's live page list}; rows not in it are null. ``lent``: the current array
        was passed to a step whose outputs are not read yet, so a change is written to a copy. Returns `array`."""
        def writable() -> np.ndarray:  # the array to write: a copy before the first write while it is lent
            nonlocal lent
            if lent:
                self.array, lent = self.array.copy(), False
            return self.array

        for row in [r for r in self._written if r not in pages_by_row]:
            writable()[row, : self._written.pop(row)[1]] = NULL_BLOCK
        width = self.array.shape[1]
        for row, pages in pages_by_row.items():
            mirrored, written = self._written.get(row, (None, 0))
            n = len(pages)
            if n > width:
                raise ValueError(f"row {row} holds {n} blocks, more than max_blocks={width}")
            start = written if mirrored is pages and n >= written else 0
            if start == 0 and written > n:
                writable()[row, n:written] = NULL_BLOCK
            if n > start:
                writable()[row, start:n] = pages[start:n]
            self._written[row] = (pages, n)
        return self.array
