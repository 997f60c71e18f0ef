"""Dense (causal) MLA over the paged latent cache: absorbed attention of each query over ALL of its sequence's cached
positions. It serves MLA layers without a DSA indexer (Kimi-Linear, K3's MLA layers without an indexer).

For every query (b, t) at sequence position p = query_pos[b, t], keys are the rows `[lat (R) | k_rope]` (c = R + rope,
shared by all heads: MQA) at positions 0 … p and values their first R = `value_dim` columns:

    o[b,t,h] = Σ_{s ≤ p} softmax_s(scale · q[b,t,h]·kv_s) · kv_s[:R],   lse[b,t,h] = log Σ_{s ≤ p} exp(scale · q·kv_s)

p < 0 marks a padding query: o = 0, lse = −inf. This is exactly `sparse.sparse_mla` with idx = every position ≤ p
(the tests use that as the oracle), without building or prefetching an index per cached token.

Rows are read from the pool parts `[num_blocks, page, w]` in their stored form and dequantised with
`fmt.dequantize(parts, layer_scale)` (the `sparse.sparse_mla` contract, e.g. `kimi_jax.quant.LatentFormat`).
`reference` (below) is the definition: an fp32 online softmax over the block table a few page columns at a time,
up to the furthest query's page only, queries in chunks so that one step's logits stay bounded. The TPU kernel
(`paged_dense_tpu.py`) runs decode (T = 1) for single-part row formats, the GPU one (`sparse_gpu_triton.causal_decode`,
the sparse kernel walking positions 0 … p itself) decode for bf16 / fp8 / nvfp4 rows; "auto" takes the platform's
kernel when it fits and the reference everywhere else. Prefill chunks take the reference, whose `precision="storage"`
form runs its products in bf16 with fp32 accumulation.
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp

from ..paged import DSA_BACKENDS, check_precision, resolve_dsa_backend
from . import paged_dense_tpu, sparse_gpu_triton
from .reference import PRECISION, online_softmax_finish, online_softmax_init, online_softmax_step
from .sparse import DEFAULT_MAX_BLOCK_BYTES, _chunked

BACKENDS = DSA_BACKENDS


PAGES_PER_STEP = 8  # pages one step of the reference's online softmax reads (512 keys at the 64-token page)
# A query slice's step keeps its logits `[B, Tq, H, P·page]` float32 about four times over (logits, mask, weights,
# their exponent) within a budget: 64 MiB for the exact definition; 1 GiB for the storage-precision form, so that a
# prefill chunk of 4,096 queries × 32 heads × 512 keys goes in one slice (each slice is a serial loop over the pages).
STORAGE_MAX_BLOCK_BYTES = 1 << 30


def _online_softmax_pages(q_bthc, pos_bt, kv_parts, block_tables, layer_scale, *, fmt, scale, value_dim,
                          pages_per_step: int, precision: str = "exact"):
    """Online softmax over the table's pages in order, ``pages_per_step`` at a time, up to the page of the
    furthest query (a loop of dynamic length: a prefill chunk early in a long table reads only the pages before it,
    not the table's whole width): q `[B, T, H, c]`, pos `[B, T]` -> (o, lse). `precision`: "exact" (fp32 operands,
    fp32 products) or "storage" (q, rows and the softmax weights rounded to bfloat16 for the two products, fp32
    accumulation, running max and sums: what the tensor cores / MXU run at full rate, flash attention's practice)."""
    B, T, H, c = q_bthc.shape
    page = kv_parts[0].shape[1]
    P = pages_per_step
    bt = jnp.asarray(block_tables, jnp.int32)
    steps = -(-bt.shape[1] // P)
    bt = jnp.pad(bt, ((0, 0), (0, steps * P - bt.shape[1])))  # the padding's positions lie past every query
    exact = precision == "exact"
    dot_dtype = jnp.float32 if exact else jnp.bfloat16
    q = q_bthc.astype(jnp.float32).astype(dot_dtype)
    dot_kw = dict(precision=PRECISION) if exact else dict(preferred_element_type=jnp.float32)
    last_b = jnp.max(pos_bt, axis=1)  # [B] each row's furthest query (−1: padding only)
    used = jnp.clip((jnp.max(last_b) + P * page) // (P * page), 0, steps)  # steps holding a position ≤ a query

    def step(j, carry):
        cols = jax.lax.dynamic_slice_in_dim(bt, j * P, P, axis=1)  # [B, P]
        rows = fmt.dequantize(tuple(p[cols].reshape(B, P * page, p.shape[-1]) for p in kv_parts), layer_scale)
        rows = rows.astype(jnp.float32)  # [B, P·page, c]
        s_pos = j * P * page + jnp.arange(P * page, dtype=jnp.int32)  # [P·page]
        valid = (s_pos[None, None, :] <= pos_bt[:, :, None])[:, :, None, :]  # [B, T, 1, P·page]
        rows = jnp.where((s_pos[None, :] <= last_b[:, None])[..., None], rows, 0.0).astype(dot_dtype)
        s = jnp.einsum("bthc,bjc->bthj", q, rows, **dot_kw) * scale
        values = lambda p: jnp.einsum("bthj,bjr->bthr", p.astype(dot_dtype), rows[..., :value_dim], **dot_kw)
        return online_softmax_step(carry, s, valid, values)

    carry = jax.lax.fori_loop(0, used, step, online_softmax_init(B, T, H, value_dim))
    return online_softmax_finish(carry)


@partial(jax.jit, static_argnames=("fmt", "scale", "value_dim", "q_chunk", "pages_per_step", "precision"))
def reference(q_bthc, kv_parts, block_tables, query_pos_bt, layer_scale=1.0, *, fmt, scale: float, value_dim: int,
              q_chunk: Optional[int] = None, pages_per_step: Optional[int] = None, precision: str = "exact"):
    """The definition (plain jnp, any format, any T). Shapes as `dense_paged_mla`. Keys are read
    `pages_per_step` pages at a time (default `PAGES_PER_STEP`, at most the table's width), queries in chunks of
    `q_chunk` (default: four copies of one step's logits `[B, Tq, H, P·page]` float32 within 64 MiB, 1 GiB at
    `precision="storage"`: bf16 operands, fp32 accumulation, see `_online_softmax_pages`)."""
    check_precision(precision)
    B, T, H, _ = q_bthc.shape
    page = kv_parts[0].shape[1]
    P = max(1, min(pages_per_step or PAGES_PER_STEP, block_tables.shape[1]))
    if q_chunk is None:
        budget = DEFAULT_MAX_BLOCK_BYTES if precision == "exact" else STORAGE_MAX_BLOCK_BYTES
        q_chunk = int(max(1, min(T, budget // max(1, 4 * B * H * P * page * 4))))
    pos = jnp.asarray(query_pos_bt, jnp.int32)

    def fn(q, pos_bt1):
        return _online_softmax_pages(q, pos_bt1[..., 0], tuple(kv_parts), block_tables, layer_scale, fmt=fmt,
                                     scale=scale, value_dim=value_dim, pages_per_step=P, precision=precision)

    return _chunked(q_bthc, pos[..., None], q_chunk, fn)  # padded chunk rows get pos −1: padding queries


def _kernel_supports(kind: str, fmt, T: int, kv_parts) -> bool:
    if T != 1:
        return False
    if kind == "gpu":
        return sparse_gpu_triton.available() and sparse_gpu_triton.fits(fmt)
    return kind == "tpu" and paged_dense_tpu.supports(fmt, kv_parts)


def dense_paged_mla(q_bthc, kv_parts, block_tables, query_pos_bt, *, fmt, scale: float, value_dim: int,
                    layer_scale=1.0, backend: str = "auto", platform: Optional[str] = None,
                    precision: str = "exact"):
    """Causal absorbed MQA over the paged latent cache.

    q `[B, T, H, c]` (absorbed query `[q_nope·W_UK | q_rope]`, any float dtype), kv_parts: the layer pool's latent
    parts `[num_blocks, page, w]` in format `fmt`, block_tables `[B, max_blocks]` int32, query_pos `[B, T]` int32
    (the query's sequence position; it attends to positions 0 … query_pos; < 0 = padding query).
    Returns (o `[B, T, H, value_dim]` float32, lse `[B, T, H]` float32); a query with no key gets o = 0, lse = −inf.
    `backend`: "reference", "tpu" / "tpu_interpret" (decode only, T = 1, single-part rows), "gpu" / "triton" /
    "gpu_interpret" (decode only, bf16 / fp8 / nvfp4 rows), or "auto" (the kernel of `platform` — "cpu" | "tpu" |
    "gpu" / "cuda", None = the default backend's — when the call fits it, else the reference). `precision`: "exact"
    (fp32 products) or "storage" (the reference in bf16 operands with fp32 accumulation, the GPU kernel's
    `sparse_gpu_triton.storage_preset`; within the quantised formats' 5e-3 bar); the TPU decode kernel is unchanged.
    """
    B, T, H, c = q_bthc.shape
    which = resolve_dsa_backend(backend, op="dense paged MLA",
                                supported=lambda kind: _kernel_supports(kind, fmt, T, tuple(kv_parts)),
                                platform=platform)
    check_precision(precision)
    pos = jnp.asarray(query_pos_bt, jnp.int32)
    if which != "reference" and T != 1:
        raise ValueError(f"the {which} dense paged MLA kernel is decode-only (T = 1), got T = {T}")
    if which.startswith("gpu"):
        knobs = sparse_gpu_triton.storage_preset(B, H) if precision == "storage" else {}
        o, lse = sparse_gpu_triton.causal_decode(q_bthc[:, 0], tuple(kv_parts), block_tables, pos[:, 0], fmt=fmt,
                                                 scale=scale, value_dim=value_dim, layer_scale=layer_scale,
                                                 interpret=which == "gpu_interpret", **knobs)
        return o[:, None], lse[:, None]
    if which != "reference":
        o, lse = paged_dense_tpu.decode(q_bthc[:, 0], tuple(kv_parts), block_tables, pos[:, 0], fmt=fmt,
                                        scale=scale, value_dim=value_dim, layer_scale=layer_scale,
                                        interpret=which == "tpu_interpret")
        return o[:, None], lse[:, None]
    return reference(q_bthc, tuple(kv_parts), block_tables, pos, layer_scale, fmt=fmt, scale=scale,
                     value_dim=value_dim, precision=precision)
