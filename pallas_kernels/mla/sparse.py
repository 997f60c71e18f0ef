"""Sparse MLA (DSA, docs/model.md §5–6) over the paged latent cache: absorbed attention over each query's top-k latent
rows.

For every query (b, t), keys are the gathered rows `kv[idx[b,t,j]]` = `[lat (R) | k_rope]` (c = R + rope = 576 at full
size, shared by all heads: MQA) and values their first R = `value_dim` columns:

    o[b,t,h] = Σ_j softmax_j(scale · q[b,t,h]·kv_j) · kv_j[:R],     lse[b,t,h] = log Σ_j exp(scale · q·kv_j)

Entries idx < 0 are empty slots (no key). A query with no key gets o = 0 and lse = −inf (what
`pallas_kernels.mla.reference.absorbed` documents; on CPU that reference actually yields NaN there, see
tests/test_dsa_ops.py). Softmax is float32 and online over key blocks of `block_k` indices: per block
the rows are gathered from the pool in their stored form and dequantised (`fmt.dequantize(parts, layer_scale)`, e.g.
`kimi_jax.quant.LatentFormat`), so the full `[B, T, k, c]` float32 set is never built. Prefill handles queries in
chunks of `q_chunk` (default: as many as keep one block's gathered rows + logits, `[B, Tq, block_k, c + H]` float32,
under `max_block_bytes`).

(o, lse) over disjoint key sets merge exactly with `reference.merge_partials` — what decode context parallelism
uses. Public entry point: `sparse_mla` (and `decode` / `prefill`); `backend` picks the implementation, in one place
(`pallas_kernels.paged.resolve_dsa_backend`): "reference" (this jnp code), "tpu" (the Mosaic TPU decode kernel,
`sparse_tpu.py`; bf16 / fp8 rows), "gpu" (the native Triton decode kernel through jax-triton,
`sparse_gpu_triton.py`; bf16 / fp8 / nvfp4 rows), "tpu_interpret" (the TPU kernel in Pallas interpret mode) and
"gpu_interpret" (the Triton kernel in Triton's interpreter), for CPU tests, "auto" (the platform's kernel for decode
(T = 1) when it reads the format, else the reference). "triton" / "triton_interpret" are kept as other names of
"gpu" / "gpu_interpret", "pallas_tpu" / "interpret" as the older names of "tpu" / "tpu_interpret". Kernel-only
keyword arguments go through `kernel_kw` (e.g. the GPU kernel's `block_h`, `splits`, `exact`). On the GPU, fp8 rows
at `precision="storage"` with ≤ 16 heads go to the Mosaic GPU kernel (`sparse_mgpu`, one launch;
its keys are `MgpuSparseConfig` fields) and everything else to the Triton kernel; `kernel_kw={"impl": "mgpu" |
"triton", ...}` picks one explicitly.
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp

from ..paged import DSA_BACKENDS, check_precision, gather_parts, resolve_dsa_backend
from . import sparse_gpu_triton, sparse_mgpu, sparse_tpu
from .reference import PRECISION, online_softmax_finish, online_softmax_init, online_softmax_step

BACKENDS = DSA_BACKENDS
DEFAULT_BLOCK_K = 64
DEFAULT_MAX_BLOCK_BYTES = 64 << 20
_HI = PRECISION  # true fp32 products on every platform (TF32 is the Hopper default)


def online_softmax_attention(q_bthc, fetch, idx_btk, *, scale: float, value_dim: int, block_k: int = DEFAULT_BLOCK_K):
    """The core: q `[B, T, H, c]`, `fetch(idx [B, T, bk]) -> float32 rows [B, T, bk, c]`, idx `[B, T, k]` int.
    Returns (o `[B, T, H, value_dim]` float32, lse `[B, T, H]` float32)."""
    B, T, H, c = q_bthc.shape
    k = idx_btk.shape[-1]
    bk = max(1, min(block_k, k))
    n = -(-k // bk)
    idx = jnp.pad(jnp.asarray(idx_btk, jnp.int32), ((0, 0), (0, 0), (0, n * bk - k)), constant_values=-1)
    idx = jnp.moveaxis(idx.reshape(B, T, n, bk), 2, 0)  # [n, B, T, bk]
    q = q_bthc.astype(jnp.float32)

    def step(carry, idx_blk):
        ok = idx_blk >= 0
        rows = jnp.where(ok[..., None], fetch(idx_blk).astype(jnp.float32), 0.0)  # [B, T, bk, c]; empty slots 0
        s = jnp.einsum("bthc,btjc->bthj", q, rows, precision=_HI) * scale
        values = lambda p: jnp.einsum("bthj,btjr->bthr", p, rows[..., :value_dim], precision=_HI)
        return online_softmax_step(carry, s, ok[:, :, None, :], values), None

    carry, _ = jax.lax.scan(step, online_softmax_init(B, T, H, value_dim), idx)
    return online_softmax_finish(carry)


def _chunked(q_bthc, idx_btk, q_chunk: int, fn):
    """Apply fn(q, idx) over query chunks of `q_chunk` rows, one chunk at a time."""
    B, T = q_bthc.shape[:2]
    if q_chunk >= T:
        return fn(q_bthc, idx_btk)
    n = -(-T // q_chunk)
    pad = n * q_chunk - T
    q = jnp.pad(q_bthc, ((0, 0), (0, pad), (0, 0), (0, 0)))
    idx = jnp.pad(idx_btk, ((0, 0), (0, pad), (0, 0)), constant_values=-1)
    split = lambda x: jnp.moveaxis(x.reshape((B, n, q_chunk) + x.shape[2:]), 1, 0)
    o, lse = jax.lax.map(lambda a: fn(*a), (split(q), split(idx)))
    join = lambda x: jnp.moveaxis(x, 0, 1).reshape((B, n * q_chunk) + x.shape[3:])[:, :T]
    return join(o), join(lse)


def default_q_chunk(B: int, H: int, c: int, block_k: int, T: int,
                    max_block_bytes: int = DEFAULT_MAX_BLOCK_BYTES) -> int:
    """Queries per chunk so one key block's gathered rows and logits `[B, Tq, block_k, c + H]` float32 fit."""
    per_query = B * block_k * (c + H) * 4
    return int(max(1, min(T, max_block_bytes // max(1, per_query))))


@partial(jax.jit, static_argnames=("fmt", "scale", "value_dim", "block_k", "q_chunk"))
def _reference_paged(q_bthc, kv_parts, block_tables, idx_btk, layer_scale, *, fmt, scale, value_dim, block_k, q_chunk):
    def fn(q, idx):
        fetch = lambda i: fmt.dequantize(gather_parts(kv_parts, block_tables, i), layer_scale)
        return online_softmax_attention(q, fetch, idx, scale=scale, value_dim=value_dim, block_k=block_k)

    return _chunked(q_bthc, idx_btk, q_chunk, fn)


def _kernel_supports(kind: str, fmt, T: int, kv_parts=()) -> bool:
    if T != 1:
        return False
    if kind == "gpu":  # int64 row addressing: any pool size
        return sparse_gpu_triton.available() and sparse_gpu_triton.fits(fmt)
    return sparse_tpu.supports(fmt)


def _gpu_impl(which: str, kernel_kw: dict, precision: str, fmt, B: int, H: int, kv_parts) -> str:
    """Which GPU kernel: kernel_kw["impl"] when given; otherwise the Mosaic one-launch kernel for fp8 rows at
    storage precision with ≤ 16 heads (one TP shard of K3's 96), at every batch size (it measured faster than the
    native Triton storage preset at B = 1 … 32 on an H100, docs/performance.md), and the Triton kernel for everything
    else (exact products, other formats, more heads, interpret mode). `B` is kept for callers that pass it."""
    if "impl" in kernel_kw:
        return kernel_kw["impl"]
    if kernel_kw:  # settings without an impl are the Triton kernel's (block_h, splits, ...), as before mgpu
        return "triton"
    if which not in ("gpu", "triton") or precision != "storage" or H > 16 or len(kv_parts) != 1:
        return "triton"
    return "mgpu" if sparse_mgpu.supports(fmt, sparse_mgpu.MgpuSparseConfig()) else "triton"


def _pick_backend(backend: str, fmt, T: int, kv_parts=(), platform: Optional[str] = None) -> str:
    return resolve_dsa_backend(backend, op="sparse MLA",
                               supported=lambda kind: _kernel_supports(kind, fmt, T, kv_parts), platform=platform)


def sparse_mla(q_bthc, kv_parts, block_tables, idx_btk, *, fmt, scale: float, value_dim: int, layer_scale=1.0,
               block_k: int = DEFAULT_BLOCK_K, q_chunk=None, backend: str = "auto", kernel_kw=None,
               precision: str = "exact", platform: Optional[str] = None):
    """Sparse absorbed attention over the paged latent cache.

    q `[B, T, H, c]` (absorbed query `[q_nope·W_UK | q_rope]`), kv_parts: the layer pool's latent parts
    `[num_blocks, page, w]`, block_tables `[B, max_blocks]`, idx `[B, T, k]` sequence positions (−1 = empty).
    Returns (o `[B, T, H, value_dim]` float32, lse `[B, T, H]` float32).
    `block_k` is the key block of the reference and TPU kernel (the GPU kernel takes its own via kernel_kw).
    `precision`: "exact" (products to ≈ fp32 against the dequantised rows) or "storage" (the GPU kernel's faster
    single-pass settings, `sparse_gpu_triton.storage_preset`, within the quantised formats' 5e-3 bar; explicit
    kernel_kw still win; the reference and the TPU kernel are unchanged).
    `platform` ("cpu" | "tpu" | "gpu" / "cuda"; None = the default backend's) is what "auto" picks the kernel for.
    """
    B, T, H, c = q_bthc.shape
    check_precision(precision)
    if idx_btk.shape[-1] == 0:  # an empty selection is one empty slot: o = 0, lse = −inf on every backend
        idx_btk = jnp.full(tuple(idx_btk.shape[:-1]) + (1,), -1, jnp.int32)
    which = _pick_backend(backend, fmt, T, tuple(kv_parts), platform)
    kernel_kw = dict(kernel_kw or {})
    if which != "reference":
        if T != 1:
            raise ValueError(f"the {which} sparse MLA kernel is decode-only (T = 1), got T = {T}")
        common = dict(fmt=fmt, layer_scale=layer_scale, scale=scale, value_dim=value_dim)
        if which.startswith("tpu"):
            o, lse = sparse_tpu.decode(q_bthc[:, 0], tuple(kv_parts), block_tables, idx_btk[:, 0], block_k=block_k,
                                       interpret=which == "tpu_interpret", **common, **kernel_kw)
        elif _gpu_impl(which, kernel_kw, precision, fmt, B, H, kv_parts) == "mgpu":
            # the Mosaic GPU kernel (fp8 rows, storage precision; GPU only)
            if which.endswith("_interpret"):
                raise ValueError("the mgpu sparse MLA kernel has no interpret mode; use impl='triton' on CPU")
            cfg = sparse_mgpu.MgpuSparseConfig(**{k: v for k, v in kernel_kw.items() if k != "impl"})
            o, lse = sparse_mgpu.decode(q_bthc[:, 0], tuple(kv_parts), block_tables, idx_btk[:, 0], config=cfg,
                                        **common)
        else:
            kernel_kw.pop("impl", None)  # "triton": the Triton kernel
            if precision == "storage":
                kernel_kw = dict(sparse_gpu_triton.storage_preset(B, H), **kernel_kw)
            o, lse = sparse_gpu_triton.decode(q_bthc[:, 0], tuple(kv_parts), block_tables, idx_btk[:, 0],
                                              interpret=which.endswith("_interpret"), **common, **kernel_kw)
        return o[:, None], lse[:, None]
    if q_chunk is None:
        q_chunk = default_q_chunk(B, H, c, min(block_k, idx_btk.shape[-1]), T)
    return _reference_paged(q_bthc, tuple(kv_parts), block_tables, idx_btk, layer_scale, fmt=fmt, scale=scale,
                            value_dim=value_dim, block_k=block_k, q_chunk=q_chunk)


def decode(q_bhc, kv_parts, block_tables, idx_bk, **kw):
    """One query per sequence: q `[B, H, c]`, idx `[B, k]` -> (o `[B, H, R]`, lse `[B, H]`)."""
    o, lse = sparse_mla(q_bhc[:, None], kv_parts, block_tables, idx_bk[:, None], **kw)
    return o[:, 0], lse[:, 0]


def prefill(q_bthc, kv_parts, block_tables, idx_btk, **kw):
    """T queries per sequence, each with its own top-k set: q `[B, T, H, c]`, idx `[B, T, k]`."""
    return sparse_mla(q_bthc, kv_parts, block_tables, idx_btk, **kw)


@partial(jax.jit, static_argnames=("scale", "value_dim", "block_k", "q_chunk"))
def sparse_absorbed_dense(q_bthc, kv_bsc, idx_btk, *, scale: float, value_dim: int, block_k: int = DEFAULT_BLOCK_K,
                          q_chunk=None):
    """The same op over a contiguous cache `[B, S, c]` (any float dtype; the model's `MLACache` layout)."""
    B, T, H, c = q_bthc.shape
    S = kv_bsc.shape[1]

    def fn(q, idx):
        def fetch(i):
            flat = jnp.clip(i, 0, S - 1).reshape(B, -1)
            rows = jnp.take_along_axis(kv_bsc, flat[..., None], axis=1)
            return rows.reshape(i.shape + (c,)).astype(jnp.float32)

        return online_softmax_attention(q, fetch, idx, scale=scale, value_dim=value_dim, block_k=block_k)

    if q_chunk is None:
        q_chunk = default_q_chunk(B, H, c, min(block_k, idx_btk.shape[-1]), T)
    return _chunked(q_bthc, jnp.asarray(idx_btk, jnp.int32), q_chunk, fn)
