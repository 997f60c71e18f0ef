"""The partitioned entry points of the paged MLA path (docs/model.md §5–6): the DSA indexer's top-k and absorbed
attention over the paged latent cache, each inside a `shard_map` (`sharding.partition.shard_call`) with its own specs.

* `topk_indices`: the indexer's score is a weighted sum over its heads, so every device computes the whole
  selection for its batch rows (queries, weights and tables over data; the key pool whole on every device).
* `sparse_attention` / `dense_attention`: query heads over the tensor axis, batch rows over data, the latent pool
  whole on every device (shared by every sequence: pages are addressed by block id).

Kernels (`ForwardContext.kernels.dsa`) are decode kernels: a step with T = 1 takes the named kernel, prefill chunks
the jnp reference ("auto" decides the same per call, against `ForwardContext.platform`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.indexer import paged as index_paged
from pallas_kernels.mla import paged_dense
from pallas_kernels.mla import sparse as sparse_mla

from . import context_parallel as cp
from .context import ForwardContext
from .partition import shard_call


def dsa_backend(configured: str, num_queries: int) -> str:
    """A named kernel serves decode steps (one query per sequence); prefill chunks take the reference ("auto" makes
    the same choice inside the ops)."""
    if configured in ("auto", "reference") or num_queries == 1:
        return configured
    return "reference"


def topk_indices(ctx: ForwardContext, q_bthd, w_bth, key_parts, block_tables, query_pos_bt, topk: int, *, fmt):
    """Top-k cached positions int32 `[B, T, topk]` (−1 = empty) over the paged index keys. q `[B, T, Hi, d]`,
    w `[B, T, Hi]` float32 (scales folded in), key_parts `[num_blocks, page, w]` each, block_tables
    `[B, max_blocks]`, query_pos `[B, T]` (−1 = a padding query)."""
    kw = dict(fmt=fmt, backend=dsa_backend(ctx.kernels.dsa, q_bthd.shape[1]), precision=ctx.kernels.dsa_precision,
              **ctx.platform_kw())
    body = lambda q, w, parts, bt, pos: (index_paged.topk_indices(q, w, parts, bt, pos, topk, **kw),)
    d = ctx.axes.data
    B, T = query_pos_bt.shape
    (idx,) = shard_call(ctx, body, (q_bthd, w_bth, tuple(key_parts), block_tables, query_pos_bt),
                        ((d, None, None, None), (d, None, None), None, (d, None), (d, None)), ((d, None, None),),
                        out_shapes=((B, T, topk),))
    return idx


def sparse_attention(ctx: ForwardContext, q_bthc, kv_parts, block_tables, idx_btk, layer_scale, *, fmt,
                     scale: float, value_dim: int):
    """Absorbed attention of each query over its selected positions: q `[B, T, H, c]`, kv_parts
    `[num_blocks, page, w]` each, block_tables `[B, max_blocks]`, idx `[B, T, k]` (−1 = empty), layer_scale a
    float32 scalar. Returns (o `[B, T, H, value_dim]` float32, lse `[B, T, H]` float32)."""
    kw = dict(fmt=fmt, scale=scale, value_dim=value_dim, backend=dsa_backend(ctx.kernels.dsa, q_bthc.shape[1]),
              precision=ctx.kernels.dsa_precision, **ctx.platform_kw())
    body = lambda q, parts, bt, idx, ls: sparse_mla.sparse_mla(q, parts, bt, idx, layer_scale=ls, **kw)
    d, t = ctx.axes.data, ctx.axes.tensor
    B, T, H, _ = q_bthc.shape
    return shard_call(ctx, body, (q_bthc, tuple(kv_parts), block_tables, idx_btk, layer_scale),
                      ((d, None, t, None), None, (d, None), (d, None, None), None),
                      ((d, None, t, None), (d, None, t)), out_shapes=((B, T, H, value_dim), (B, T, H)))


def _dense_local(ctx: ForwardContext, backend: str, q_bthc, kv_parts, block_tables, query_pos_bt, layer_scale, *,
                 fmt, scale: float, value_dim: int):
    """Per device: absorbed attention of each query over every position of its pages up to `query_pos` — the dense
    paged decode kernel of the platform (TPU, GPU) or the reference (prefill chunks: keys read page by page, shared by
    the chunk's queries)."""
    return paged_dense.dense_paged_mla(q_bthc, kv_parts, block_tables, query_pos_bt, fmt=fmt, scale=scale,
                                       value_dim=value_dim, layer_scale=layer_scale, backend=backend,
                                       precision=ctx.kernels.dsa_precision, **ctx.platform_kw())


def dense_attention(ctx: ForwardContext, q_bthc, kv_parts, block_tables, query_pos_bt, layer_scale, *, fmt,
                    scale: float, value_dim: int):
    """Absorbed attention of each query over every cached position up to its own (MLA without an indexer), reading
    whole pages (`pallas_kernels.mla.paged_dense`): q `[B, T, H, c]`, query_pos `[B, T]` (−1 = a padding query:
    o = 0). Returns (o, lse) as `sparse_attention`."""
    backend = dsa_backend(ctx.kernels.dsa, q_bthc.shape[1])
    body = lambda q, parts, bt, pos, ls: _dense_local(ctx, backend, q, parts, bt, pos, ls, fmt=fmt, scale=scale,
                                                      value_dim=value_dim)
    d, t = ctx.axes.data, ctx.axes.tensor
    B, T, H, _ = q_bthc.shape
    return shard_call(ctx, body, (q_bthc, tuple(kv_parts), block_tables, query_pos_bt, layer_scale),
                      ((d, None, t, None), None, (d, None), (d, None), None),
                      ((d, None, t, None), (d, None, t)), out_shapes=((B, T, H, value_dim), (B, T, H)))


# ------------------------------------------------------------------------------------------------------------------
# decode context parallelism (DCP) over the paged cache
# ------------------------------------------------------------------------------------------------------------------
# With `ctx.dcp = N` the latent pages and index keys of every sequence are split over the DCP axis token by token,
# round-robin: global position p lives on rank p mod N at local position p div N, in the pages the (shared) block
# table names — every rank has its own pool `[num_blocks, 64, w]` (the global array `[N · num_blocks, 64, w]` split
# on dim 0), one table entry covers 64 local = 64·N global positions. A query attends on each rank to its own keys
# (local causal bound floor((pos − r) / N)) and the partial results merge by log-sum-exp; under the DSA indexer each
# rank keeps a local top-k of (score, position), the N·k candidates are gathered and cut to the global top-k (score
# descending, earlier position first: the reference's tie rule), and each rank attends to the winners it owns.
# Under the engine's token-split prefill (`ctx.token_split`: traced manual over the DCP axis, each device holding a
# contiguous slice of a prefill chunk) the callers pass the whole chunk's queries on every rank, and the merge
# keeps each rank's own slice of them (`_own_tokens`).

def _own_tokens(ctx: ForwardContext):
    """Which dimension of the merged (o, lse) each rank keeps its own share of: under the engine's token-split
    prefill (`ctx.token_split`, manual over the DCP axis) every rank attends the whole chunk's queries and keeps its
    own contiguous slice of the tokens (dim 1); otherwise none (every rank keeps every query)."""
    return 1 if ctx.token_split else None


def _dcp_local_pos(pos, rank, n: int):
    """Local causal bound on rank `rank` of global query positions `pos` (−1 = none: a padding query, or a rank
    holding no key yet)."""
    return jnp.where(pos >= 0, jnp.floor_divide(pos - rank, n), -1)


def dcp_write(ctx: ForwardContext, spec, pool, block_tables, starts_b, rows_btc, keys_btd=None, lengths_b=None):
    """Quantise and store T new tokens per sequence (global positions starts…starts+T−1) on the ranks that own
    them; `spec` is the (per-rank) `PagedCacheSpec`, `pool` its `LayerPool` with parts `[N · num_blocks, 64, w]`.
    Returns the updated pool."""
    n, axis = ctx.dcp, ctx.dcp_axis
    B, T, _ = rows_btc.shape
    lengths_b = jnp.full((B,), T, jnp.int32) if lengths_b is None else jnp.asarray(lengths_b, jnp.int32)
    starts_b = jnp.broadcast_to(jnp.asarray(starts_b, jnp.int32), (B,))

    def owned(starts, lengths):
        """This rank's share of the T new tokens: (their rows among the T `[B, ceil(T/N)]`, local start `[B]`,
        count `[B]`)."""
        first = jnp.mod(jax.lax.axis_index(axis) - starts, n)  # offset of this rank's first new token
        take = first[:, None] + n * jnp.arange(-(-T // n), dtype=jnp.int32)[None, :]
        return jnp.clip(take, 0, T - 1), (starts + first) // n, jnp.maximum(0, -(-(lengths - first) // n))

    def body(latent, index, scale, bt, starts, lengths, rows, *keys):
        take, local_start, count = owned(starts, lengths)
        pick = lambda a: jnp.take_along_axis(a, take[..., None], axis=1)
        new = spec.write(type(pool)(latent, index, scale), bt, local_start, pick(rows),
                         pick(keys[0]) if keys else None, count)
        return new.latent, new.index

    args = (pool.latent, pool.index, pool.latent_scale, block_tables, starts_b, lengths_b, rows_btc)
    args += () if keys_btd is None else (keys_btd,)
    in_dims = ((axis,), (axis,)) + (None,) * (len(args) - 2)
    shapes = tuple(parts[0].shape if parts else None for parts in (pool.latent, pool.index))
    latent, index = shard_call(ctx, body, args, in_dims, ((axis,), (axis,)), out_shapes=shapes)
    return type(pool)(latent, index, pool.latent_scale)


def dcp_dense_attention(ctx: ForwardContext, q_bthc, kv_parts, block_tables, query_pos_bt, layer_scale, *, fmt,
                        scale: float, value_dim: int):
    """`dense_attention` over a DCP-split pool: each rank attends to its own positions, merged by log-sum-exp.
    Returns (o `[B, T, H, value_dim]`, lse `[B, T, H]`) float32, the same on every rank (under the token split:
    each rank's own `[B, T / N, ...]` slice of the tokens)."""
    n, axis = ctx.dcp, ctx.dcp_axis
    backend = dsa_backend(ctx.kernels.dsa, q_bthc.shape[1])

    def body(q, parts, bt, pos, ls):
        local_pos = _dcp_local_pos(pos, jax.lax.axis_index(axis), n)
        o, lse = _dense_local(ctx, backend, q, parts, bt, local_pos, ls, fmt=fmt, scale=scale, value_dim=value_dim)
        return cp.merge_over_axis(o, lse, axis, _own_tokens(ctx))

    B, T, H, _ = q_bthc.shape
    return shard_call(ctx, body, (q_bthc, tuple(kv_parts), block_tables, query_pos_bt, layer_scale),
                      (None, (axis,), None, None, None), (None, None),
                      out_shapes=((B, T, H, value_dim), (B, T, H)))


def dcp_sparse_attention(ctx: ForwardContext, q_bthc, qi_bthd, w_bth, kv_parts, key_parts, block_tables,
                         query_pos_bt, layer_scale, topk: int, *, latent_fmt, index_fmt, scale: float,
                         value_dim: int):
    """The DSA path over a DCP-split pool: local index scores and top-k per rank, the global top-k of the gathered
    candidates, sparse attention per rank over the winners it owns, merged by log-sum-exp. Equal to the one-device
    selection (every global winner is in its owner's local top-k). q `[B, T, H, c]`, qi `[B, T, Hi, d]`,
    w `[B, T, Hi]`. Returns (o `[B, T, H, value_dim]`, lse `[B, T, H]`) float32 (under the token split: each rank's
    own `[B, T / N, ...]` slice of the tokens)."""
    n, axis = ctx.dcp, ctx.dcp_axis
    backend = dsa_backend(ctx.kernels.dsa, q_bthc.shape[1])

    def body(q, qi, w, parts, kparts, bt, pos, ls):
        r = jax.lax.axis_index(axis)
        local_pos = _dcp_local_pos(pos, r, n)  # [B, T]
        s_bts = index_paged.score_rows(qi, w, kparts, bt, local_pos, fmt=index_fmt, backend=backend,
                                       **ctx.platform_kw())  # [B, T, S_local], −inf where not allowed
        s_bts = jnp.where(s_bts == 0, 0.0, s_bts)  # -0.0 == +0.0 for the tie rule
        S = s_bts.shape[-1]
        val, loc = jax.lax.top_k(s_bts, min(topk, S))  # this rank's best, earlier local position first on ties
        _, win_pos = cp.merge_topk_candidates(val, loc * n + r, axis, topk)  # [B, T, topk], −1 past the winners
        idx = jnp.where((win_pos >= 0) & (jnp.mod(win_pos, n) == r), win_pos // n, -1)
        o, lse = sparse_mla.sparse_mla(q, parts, bt, idx, fmt=latent_fmt, scale=scale, value_dim=value_dim,
                                       layer_scale=ls, backend=backend, precision=ctx.kernels.dsa_precision,
                                       **ctx.platform_kw())
        return cp.merge_over_axis(o, lse, axis, _own_tokens(ctx))

    B, T, H, _ = q_bthc.shape
    return shard_call(ctx, body, (q_bthc, qi_bthd, w_bth, tuple(kv_parts), tuple(key_parts), block_tables,
                                  query_pos_bt, layer_scale),
                      (None, None, None, (axis,), (axis,), None, None, None), (None, None),
                      out_shapes=((B, T, H, value_dim), (B, T, H)))
