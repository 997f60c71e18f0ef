"""Row plans of the Mosaic GPU MXFP4 kernels (XLA side): rows sorted by expert padded per expert to whole tiles.

`tile_plan` / `slot_tile_plan` -> `TilePlan` (src `[m_pad]`, tile -> expert `[t_max]`, live tiles `[1]`, padded
row of each row `[M]`, live mask `[M]`), with t_max = ceil(M / rows) + min(M, E) − 1 (`schedule.tiles_bound`) and
m_pad = t_max · rows: the padded arrays scale with the rows, not with the experts (one token routed to 8 of 256
experts: 8 tiles, not 257). `prepare_rows` gives the padded-plan kernels their x planes `[2, m_pad, K/2]` bf16;
`gather_x` the tile layout's; `unpad_output` brings a padded result back to `[M, N]`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

import pallas_kernels.moe.schedule as schedule
from .layout import _planes_in_contraction_order


def _group_of(ends, idx):
    """Group of each index for sorted group ends: a count of the ends ≤ idx (a compare-all, no search loop: XLA's
    `searchsorted` scan costs tens of µs of small kernels on the GPU)."""
    return jnp.sum(idx[:, None] >= ends[None, :], axis=1, dtype=jnp.int32)


def _tiles(group_sizes, E: int, t_max: int, rows: int):
    """Per-group padding to `rows`: (tile -> group `[t_max]`, live tiles `[1]`, padded row start per group)."""
    sizes = group_sizes.astype(jnp.int32)
    tiles_g = (sizes + rows - 1) // rows
    tile_end = jnp.cumsum(tiles_g)
    tile_start = tile_end - tiles_g
    tile_group = jnp.minimum(_group_of(tile_end, jnp.arange(t_max, dtype=jnp.int32)), E - 1)
    return tile_group, tile_end[-1:], tile_start * rows


def _pad_plan(group_sizes, M: int, num_experts: int, rows: int):
    """Rows padded per group to multiples of `rows`, as gathers only (no scatter) -> (source row of each padded row
    `[m_pad]` (M: a zero row), tile -> group `[t_max]`, live tiles `[1]`, padded row of each input row `[M]`, live
    row mask `[M]`)."""
    E = num_experts
    t_max = schedule.tiles_bound(M, E, rows)
    m_pad = t_max * rows
    tile_group, num_tiles, pad_start = _tiles(group_sizes, E, t_max, rows)
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    # padded row p: tile p // rows of group g, k-th padded row of g; a real row while k < the group's size
    p = jnp.arange(m_pad, dtype=jnp.int32)
    g = tile_group[p // rows]
    k = p - pad_start[g]
    src = jnp.where((p // rows < num_tiles[0]) & (k < sizes[g]), starts[g] + k, M)
    # padded row of each sorted row; rows past Σ sizes read the last padded row, and `live` zeroes what they read
    row = jnp.arange(M, dtype=jnp.int32)
    g_of_row = jnp.minimum(_group_of(ends, row), E - 1)
    live = row < ends[-1]
    pad_row = jnp.where(live, pad_start[g_of_row] + row - starts[g_of_row], m_pad - 1)
    return src, tile_group, num_tiles, pad_row, live


def _pad_rows(x, group_sizes, num_experts: int, rows: int):
    """Rows padded per group to multiples of `rows` -> (x's rows in padded order `[m_pad, K]` (zeros between
    groups), tile -> group `[t_max]`, live tiles `[1]`, padded row of each input row `[M]`, live row mask `[M]`)."""
    src, *plan = _pad_plan(group_sizes, x.shape[0], num_experts, rows)
    return (x.at[src].get(mode="fill", fill_value=0), *plan)


def prepare_rows(x, group_sizes, num_experts: int, rows: int = 16):
    """XLA side of the bf16 path: `_pad_rows`, x split into even / odd elements in the kernel's contraction order
    -> (x planes `[2, m_pad, K/2]` bf16 (even, odd: one copy per step brings both), tile -> group, live tiles, padded
    row of each input row, live row mask)."""
    x_rows, tile_group, num_tiles, pad_row, live = _pad_rows(x.astype(jnp.bfloat16), group_sizes, num_experts, rows)
    return _planes_in_contraction_order(x_rows), tile_group, num_tiles, pad_row, live


def group_bounds(group_sizes, M: int):
    """`group_sizes [E]` -> row bounds `[E + 2]` int32: expert e's rows are [b[e], b[e + 1]) (sizes clipped so that
    every bound lies in [0, M]); the rows [b[E], b[E + 1] = M) past Σ sizes, which the kernel zeroes."""
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes.astype(jnp.int32), 0)), M)
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), ends, jnp.full((1,), M, jnp.int32)])


class TilePlan(NamedTuple):
    """Rows padded per expert to whole tiles of `rows` (`tile_plan`): the layout `expert_ffn_tiled` keeps x, the
    gate / up outputs, h and the down output in, so the padding happens once per FFN instead of around each matmul."""
    src: jax.Array  # [m_pad] int32: the sorted row each padded row holds (M: none, a zero row)
    tile_group: jax.Array  # [t_max] int32: each tile's expert (dead tiles: clamped, never computed)
    num_tiles: jax.Array  # [1] int32: live tiles
    pad_row: jax.Array  # [M] int32: each sorted row's padded row
    live: jax.Array  # [M] bool: rows inside Σ group_sizes


def tile_plan(group_sizes, M: int, num_experts: int, rows: int) -> TilePlan:
    """The padded-row plan of `M` sorted rows over `group_sizes [E]` for `rows`-row tiles (`_pad_plan`)."""
    return TilePlan(*_pad_plan(group_sizes, M, num_experts, rows))


def slot_tile_plan(expert_idx_nk, num_experts: int, rows: int) -> TilePlan:
    """The tile layout of routed (token, slot) pairs planned from the routing itself, `expert_idx_nk [N, k]` int.
    The plan's rows are the pairs in (token, slot) order (row i = pair i: token i // k, slot i % k), not sorted by
    expert: `src [m_pad]` holds each padded row's pair (N·k: none), `pad_row [N·k]` each pair's padded row and
    `live` is all true. Each expert's pairs fill its tiles in pair order, so the padded rows hold exactly what
    `tile_plan` of the sorted pairs puts there (`ops.dispatch_plan`'s stable sort) — without the sorted rows:
    no order scatter, no per-row group search, no index composed for the combine. `expert_ffn_tiled(plan=…)`
    runs the FFN on it and returns the pairs' rows in (token, slot) order, which is what the combine reads."""
    expert = expert_idx_nk.reshape(-1).astype(jnp.int32)
    pairs = expert.shape[0]
    rank, sizes = schedule.expert_ranks(expert, num_experts)
    t_max = schedule.tiles_bound(pairs, num_experts, rows)
    tile_group, num_tiles, pad_start = _tiles(sizes, num_experts, t_max, rows)
    pad_row = pad_start[expert] + rank
    src = jnp.full((t_max * rows,), pairs, jnp.int32).at[pad_row].set(jnp.arange(pairs, dtype=jnp.int32),
                                                                       unique_indices=True)
    return TilePlan(src, tile_group, num_tiles, pad_row, jnp.ones((pairs,), bool))


def gather_x(x, src, token_of_row=None):
    """x's rows in a tile layout: `x [M, K]` sorted rows -> `x[src]` `[len(src), K]` bf16 (src = M: a zero row), whose
    planes the kernel's wrapper makes (`_tile_layout_operands`: a transpose XLA fuses into this gather). With
    `token_of_row [M]`, `x [N, K]` is the tokens the sorted rows come from (sorted row i = x[token_of_row[i]]): the
    planes are made on the N tokens (k times fewer rows) and the gather moves contiguous half-rows -> planes
    `[2, len(src), K/2]`, and the sorted rows `[M, K]` are never materialised. `token_of_row` an int k: the rows are
    routed pairs in (token, slot) order, row i token i // k (computed inside the gather, not gathered itself)."""
    if token_of_row is None:
        return x.astype(jnp.bfloat16).at[src].get(mode="fill", fill_value=0)
    N = x.shape[0]
    if isinstance(token_of_row, int):
        tok = jnp.where(src < N * token_of_row, src // token_of_row, N)
    else:
        tok = token_of_row.at[src].get(mode="fill", fill_value=N)
    return _planes_in_contraction_order(x.astype(jnp.bfloat16)).at[:, tok].get(mode="fill", fill_value=0)


def unpad_output(out_pad, pad_row, live, out_dtype, row_scale=None):
    """The kernel's out `[m_pad, N]` -> `[M, N]` `out_dtype`: each input row's padded row (`pad_row [M]`), times
    `row_scale[padded row]` if given (the fp8 path's 1/row scale, the placed layout's `out_scale`), zeros where
    `live [M]` is false."""
    out = out_pad[pad_row]
    if row_scale is not None:
        out = out * row_scale[pad_row][:, None]
    return jnp.where(live[:, None], out, 0).astype(out_dtype)
