"""RMSNorm: the definition (`rmsnorm_reference`) and a native Triton kernel for decode-sized batches on a GPU.

    rmsnorm(x [..., D], weight [D], eps, backend) -> [..., D] in x.dtype

weight · x / sqrt(mean(x²) + eps), statistics in float32, the weight applied after the cast to x.dtype (as the
reference implementations do). XLA launches two kernels per norm on a GPU (the reduction, then the normalisation);
the Triton kernel is one program per row (`_rmsnorm_kernel`). It runs for batches of up to `MAX_ROWS` rows — a decode
step's — and prefill keeps XLA's fusions. Equal to the reference up to the order of the row's sum of squares.
Backends: "reference", "gpu" (jax-triton), "gpu_interpret" (Triton's interpreter: CPU tests), "auto" (the kernel on
a GPU where jax-triton can launch, else the reference).
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp

from .platform import resolve_platform
from .triton_call import available, call, jit, tl

__all__ = ["BACKENDS", "MAX_ROWS", "resolve_backend", "rmsnorm", "rmsnorm_reference"]

BACKENDS = ("reference", "gpu", "gpu_interpret")
MAX_ROWS = 256  # rows a batch may have for the kernel: decode steps and speculative verification, not prefill


def rmsnorm_reference(x, weight, eps: float):
    """The definition: `[..., D]` -> `[..., D]` in x.dtype."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * y.astype(x.dtype).astype(jnp.float32)).astype(x.dtype)


@jit
def _rmsnorm_kernel(x_ptr, w_ptr, o_ptr, D: tl.constexpr, BD: tl.constexpr, EPS: tl.constexpr):
    """Program r: row r of x `[rows, D]` normalised (`rmsnorm_reference`)."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BD)
    inside = c < D
    x = tl.load(x_ptr + r * D + c, mask=inside, other=0.0)
    xf = x.to(tl.float32)
    y = (xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / D + EPS)).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + c, mask=inside, other=0.0).to(tl.float32)
    tl.store(o_ptr + r * D + c, (w * y).to(o_ptr.dtype.element_ty), mask=inside)


def resolve_backend(backend: str = "auto", platform: Optional[str] = None) -> str:
    """"auto" -> "gpu" on a GPU where jax-triton can launch, else "reference"; other names as they are."""
    if backend == "auto":
        return "gpu" if resolve_platform(platform) == "gpu" and available() else "reference"
    if backend not in BACKENDS:
        raise ValueError(f"unknown norm backend {backend!r}; choose one of {', '.join(BACKENDS)} or 'auto'")
    return backend


def rmsnorm(x, weight, eps: float, backend: str = "auto", platform: Optional[str] = None):
    """RMSNorm of `x [..., D]` with `weight [D]` -> `[..., D]` in x.dtype, by `backend` (the kernel for batches of at
    most `MAX_ROWS` rows; larger ones and empty ones take the reference)."""
    be = resolve_backend(backend, platform)
    rows = math.prod(x.shape[:-1])
    if be == "reference" or not 0 < rows <= MAX_ROWS:
        return rmsnorm_reference(x, weight, eps)
    D = x.shape[-1]
    out = call(x.reshape(rows, D), weight, kernel=_rmsnorm_kernel, out_shape=jax.ShapeDtypeStruct((rows, D), x.dtype),
               grid=(rows,), interpret=be == "gpu_interpret", num_warps=4 if D <= 4096 else 8, num_stages=1,
               name="rmsnorm", D=D, BD=1 << (D - 1).bit_length(), EPS=float(eps))
    return out.reshape(x.shape)
