"""`matmul`: a matrix product that stays a GEMM on a GPU when it has one row (a decode step's projections).

XLA's GPU compiler rewrites a dot whose one side is a vector, against a matrix of under 10M elements, into a
broadcast multiply and a reduction (its DotStrengthReduction pass, not switchable by a flag). At one decode row that
turns each projection into two to four kernels, some writing the float32 product `[K, N]` out before reducing it
(twice the weight's bytes written and read again). Lowered for a GPU, a single row is therefore padded to two and the
result sliced back: the dot stays a matmul (one GEMM fusion, which also merges the projections sharing an input).
Other platforms lower the plain dot (`jax.lax.platform_dependent`); padding changes the summation order at most.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

__all__ = ["matmul"]


def matmul(x_mk, w_kn, precision=None):
    """`x [..., K] @ w [K, N]` -> float32 `[..., N]`, on a GPU a matrix product even for one row. `precision`: as
    `jnp.dot`'s."""
    def plain(x, w):
        return jnp.dot(x, w, precision=precision, preferred_element_type=jnp.float32)

    if math.prod(x_mk.shape[:-1]) != 1:
        return plain(x_mk, w_kn)

    def two_rows(x, w):
        x_1k = x.reshape(1, x.shape[-1])
        y_2n = plain(jnp.concatenate([x_1k, jnp.zeros_like(x_1k)]), w)
        return y_2n[:1].reshape(*x.shape[:-1], w.shape[-1])

    return jax.lax.platform_dependent(x_mk, w_kn, cuda=two_rows, rocm=two_rows, default=plain)
