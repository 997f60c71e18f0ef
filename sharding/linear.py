"""The entry point of the dense projections (`kimi_jax.modules.layers.Linear`): `x @ w` with float32 accumulation,
through XLA's dot or, for decode-size inputs on a GPU, the split-K Triton kernel (`pallas_kernels.linear_gpu_triton`).

A decode step multiplies 1 … 32 rows by every weight matrix of the model, and XLA reads a weight at 0.2-0.35 of
the copy rate there (`bench/gemv.py`); the kernel is built to read it once at close to copy rate. It takes the
projection when `ForwardContext.kernels.linear` resolves to it ("auto": on a GPU where jax-triton launches), the
program runs on one device (a weight split over a mesh stays with XLA, which partitions its dot), the input has at
most `MAX_ROWS` rows in all and the weight is bf16 / f16 with dims that are multiples of 16; everything else is
`jnp.dot`.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from pallas_kernels import linear_gpu_triton
from pallas_kernels.platform import resolve_platform

from .context import ForwardContext


def backend(ctx: ForwardContext, rows: int, w_kn) -> str:
    """"gpu" / "gpu_interpret" (the kernel) or "reference" (XLA's dot) for `rows` input rows times w `[K, N]`."""
    kind = {"triton": "gpu", "triton_interpret": "gpu_interpret"}.get(ctx.kernels.linear, ctx.kernels.linear)
    if kind == "reference" or (ctx.mesh is not None and ctx.mesh.size > 1):
        return "reference"
    if not linear_gpu_triton.supports(rows, *w_kn.shape, w_kn.dtype):
        return "reference"
    if kind == "auto":
        on_gpu = resolve_platform(ctx.platform) == "gpu"
        return "gpu" if on_gpu and linear_gpu_triton.available() else "reference"
    return kind


def project(ctx: ForwardContext, x, w_kn, out_dtype=None):
    """x `[..., K]` @ w `[K, N]` -> `[..., N]` in `out_dtype` (default x's), float32 accumulation, x cast to w's
    dtype first."""
    rows = math.prod(x.shape[:-1])
    which = backend(ctx, rows, w_kn)
    if which == "reference":
        y = jnp.dot(x.astype(w_kn.dtype), w_kn, preferred_element_type=jnp.float32)
        return y.astype(out_dtype or x.dtype)
    y = linear_gpu_triton.skinny_matmul(x.reshape(rows, x.shape[-1]), w_kn, out_dtype=out_dtype or x.dtype,
                                        interpret=which == "gpu_interpret")
    return y.reshape(*x.shape[:-1], w_kn.shape[1])
