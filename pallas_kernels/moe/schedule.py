"""Row-tile schedules for grouped matmuls: which rows and which expert each program of a kernel works on.

The grid of a kernel is static, the group sizes are data; so the grid is an upper bound on the tile count and
programs past `num_tiles` do nothing. Rows not covered by any group (M > Σ sizes) form a pseudo-group with id E
that the kernels fill with zeros (ragged_dot semantics) without reading a weight.

* `group_tiles` (GPU): tiles never straddle groups. Group g gets ceil(size_g / bm) tiles starting at its own first
  row (not at a multiple of bm) — pointer-based loads need no alignment. Σ ceil(s/bm) tiles, the fewest possible.
* `expert_ranks`: where each routed (token, slot) pair falls inside its expert's rows — the dispatch plan without
  a sort (decode-sized batches are ranked by counting).
* `straddle_tiles` (TPU): tiles are the aligned row blocks of x (BlockSpec index maps address whole blocks); a block
  shared by k groups is visited k times in a row, each visit storing only its group's rows (megablox layout).
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class GroupTiles(NamedTuple):
    group: jnp.ndarray  # [T] int32, expert of the tile (E = zero-fill)
    row0: jnp.ndarray  # [T] int32, first row of the tile
    row_end: jnp.ndarray  # [T] int32, end of the tile's group (rows [row0, min(row0 + bm, row_end)))
    num_tiles: jnp.ndarray  # [1] int32, tiles in use (programs of higher tile index exit)


def _with_tail(group_sizes, m_rows: int):
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    total = ends[-1] if sizes.shape[0] else jnp.int32(0)
    tail = jnp.maximum(jnp.int32(m_rows) - total, 0)
    sizes_z = jnp.concatenate([sizes, tail[None]])
    starts_z = jnp.concatenate([ends - sizes, jnp.minimum(total, m_rows)[None]])
    return sizes_z, starts_z


def tiles_bound(m_rows: int, num_groups: int, bm: int) -> int:
    """Tiles of `bm` rows enough for M rows split over any sizes of `num_groups` groups, each group padded to whole
    tiles: at most n = min(M, groups) groups hold rows, and Σ_g ceil(s_g / bm) < M/bm + n, so ceil(M/bm) + n − 1;
    ≥ 1. It scales with the rows, not the groups: one token routed to 8 of 256 experts, 8 tiles of 16 rows."""
    return max(1, cdiv(m_rows, bm) + min(m_rows, num_groups) - 1)


def num_group_tiles_bound(m_rows: int, num_groups: int, bm: int) -> int:
    """Tiles of `group_tiles` for any sizes summing to M: `tiles_bound` over the E groups and the tail pseudo-group."""
    return tiles_bound(m_rows, num_groups + 1, bm)


def group_tiles(group_sizes, m_rows: int, bm: int) -> GroupTiles:
    E = group_sizes.shape[0]
    sizes_z, starts_z = _with_tail(group_sizes, m_rows)
    ntiles = (sizes_z + bm - 1) // bm
    tile_end = jnp.cumsum(ntiles)
    T = num_group_tiles_bound(m_rows, E, bm)
    t = jnp.arange(T, dtype=jnp.int32)
    g = jnp.minimum(jnp.searchsorted(tile_end, t, side="right", method="compare_all"), E).astype(jnp.int32)
    row0 = starts_z[g] + (t - (tile_end[g] - ntiles[g])) * bm
    row_end = starts_z[g] + sizes_z[g]
    return GroupTiles(g, row0.astype(jnp.int32), row_end.astype(jnp.int32), tile_end[-1:].astype(jnp.int32))


# Up to this many (token, slot) pairs `expert_ranks` ranks the pairs by counting instead of sorting: P² compares in
# one fused reduction. H200: XLA's GPU sort of 3,584 pairs is one CTA's bitonic sort, 31–32 µs whether
# it sorts argsort's (key, index) pair or one packed key; the counting rank took 5.9 µs.
COUNTING_SORT_MAX_PAIRS = 8192


def expert_ranks(expert_p, num_experts: int):
    """Pairs' experts `expert_p [P]` int (each in [0, num_experts)) -> (rank [P], sizes [E]) int32: rank[i] = the
    number of earlier pairs (j < i) with pair i's expert, so pair i is row `first_row[e] + rank[i]` of the pairs
    stably sorted by expert (first_row = cumsum(sizes) − sizes). Decode-sized batches (≤ `COUNTING_SORT_MAX_PAIRS`)
    count; larger ones take a stable argsort."""
    expert = expert_p.astype(jnp.int32)
    pairs = expert.shape[0]
    sizes = jnp.bincount(expert, length=num_experts).astype(jnp.int32)
    pair = jnp.arange(pairs, dtype=jnp.int32)
    if pairs <= COUNTING_SORT_MAX_PAIRS:
        same_expert_before = (expert[None, :] == expert[:, None]) & (pair[None, :] < pair[:, None])  # [P, P], [i, j]
        return jnp.sum(same_expert_before, axis=1, dtype=jnp.int32), sizes
    order = jnp.argsort(expert, stable=True)
    sorted_row = jnp.zeros_like(pair).at[order].set(pair, unique_indices=True)
    return sorted_row - (jnp.cumsum(sizes) - sizes)[expert], sizes


class StraddleTiles(NamedTuple):
    group: jnp.ndarray  # [T] int32 (E = zero-fill)
    m_block: jnp.ndarray  # [T] int32, row block index
    first_visit: jnp.ndarray  # [T] int32, 1 where the row block is visited for the first time
    group_start: jnp.ndarray  # [E + 1] int32
    group_end: jnp.ndarray  # [E + 1] int32
    num_tiles: jnp.ndarray  # [1] int32


def num_straddle_tiles_bound(m_rows: int, num_groups: int, bm: int) -> int:
    """Each boundary between two non-empty (pseudo-)groups adds at most one revisit of a block: at most
    min(M, E + 1) − 1 of them, as in `num_group_tiles_bound`."""
    return tiles_bound(m_rows, num_groups + 1, bm)


def straddle_tiles(group_sizes, m_rows: int, bm: int) -> StraddleTiles:
    """`m_rows` must be a multiple of bm. Steps past num_tiles repeat the last tile (no new DMA) and do nothing."""
    E = group_sizes.shape[0]
    sizes_z, starts_z = _with_tail(group_sizes, m_rows)
    ends_z = starts_z + sizes_z
    first_blk = starts_z // bm
    last_blk = (ends_z - 1) // bm
    nvis = jnp.where(sizes_z > 0, last_blk - first_blk + 1, 0)
    vis_end = jnp.cumsum(nvis)
    T = num_straddle_tiles_bound(m_rows, E, bm)
    num = vis_end[-1]
    t = jnp.minimum(jnp.arange(T, dtype=jnp.int32), num - 1)
    g = jnp.minimum(jnp.searchsorted(vis_end, t, side="right", method="compare_all"), E).astype(jnp.int32)
    blk = first_blk[g] + (t - (vis_end[g] - nvis[g]))
    prev = jnp.concatenate([jnp.full((1,), -1, blk.dtype), blk[:-1]])
    first = (blk != prev).astype(jnp.int32)
    return StraddleTiles(g, blk.astype(jnp.int32), first, starts_z.astype(jnp.int32), ends_z.astype(jnp.int32),
                         num[None].astype(jnp.int32))
