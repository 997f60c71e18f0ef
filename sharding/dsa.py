"""The partitioned entry points of the paged MLA path (SPEC §5–6): the DSA indexer's top-k and absorbed attention
over the paged latent cache, each inside a `shard_map` (`sharding.partition.shard_call`) with its own specs.

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


def dense_attention(ctx: ForwardContext, q_bthc, kv_parts, block_tables, query_pos_bt, layer_scale, *, fmt,
                    scale: float, value_dim: int):
    """Absorbed attention of each query over every cached position up to its own (MLA without an indexer), reading
    whole pages (`pallas_kernels.mla.paged_dense`): q `[B, T, H, c]`, query_pos `[B, T]` (−1 = a padding query:
    o = 0). Returns (o, lse) as `sparse_attention`."""
    backend = dsa_backend(ctx.kernels.dsa, q_bthc.shape[1])
    on_gpu = (ctx.platform or jax.default_backend()) in ("gpu", "cuda")
    if backend.startswith("gpu") or (backend == "auto" and on_gpu):
        # the dense kernel is TPU-only: GPUs keep their sparse kernel with every position up to the query selected
        s = jnp.arange(block_tables.shape[1] * kv_parts[0].shape[1], dtype=jnp.int32)
        idx_bts = jnp.where(s[None, None, :] <= query_pos_bt[:, :, None], s[None, None, :], -1)
        return sparse_attention(ctx, q_bthc, kv_parts, block_tables, idx_bts, layer_scale, fmt=fmt, scale=scale,
                                value_dim=value_dim)
    kw = dict(fmt=fmt, scale=scale, value_dim=value_dim, backend=backend, **ctx.platform_kw())
    body = lambda q, parts, bt, pos, ls: paged_dense.dense_paged_mla(q, parts, bt, pos, layer_scale=ls, **kw)
    d, t = ctx.axes.data, ctx.axes.tensor
    B, T, H, _ = q_bthc.shape
    return shard_call(ctx, body, (q_bthc, tuple(kv_parts), block_tables, query_pos_bt, layer_scale),
                      ((d, None, t, None), None, (d, None), (d, None), None),
                      ((d, None, t, None), (d, None, t)), out_shapes=((B, T, H, value_dim), (B, T, H)))
