"""Small building blocks: Linear (kernel `[in, out]`), RMSNorm, LayerNorm, activations.

Initialisation gives a usable random model (std in^-0.5, norm weights near 1) so tiny random instances produce
non-degenerate logits; real weights come from checkpoints.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

# the gated activations are defined beside the expert kernels that fuse them
from pallas_kernels.moe.activations import clamped_swiglu, situ, swiglu  # noqa: F401
from pallas_kernels.matmul import matmul  # noqa: F401  (one decode row stays a GEMM on a GPU)
from pallas_kernels.norm import rmsnorm_reference as rmsnorm  # noqa: F401  (the definition, beside its kernel)
from sharding import norm as sharded_norm


def param_key(rngs: nnx.Rngs):
    """The next parameter key, drawn eagerly even while a caller traces (`jax.eval_shape` of a full-size preset):
    a traced draw updates nnx's rng counter with a tracer, and each such update cost a scan of the whole trace
    (3.5-7 min for K3.1's 2,970 draws); eager draws keep the abstract build to the parameters' own ops."""
    with jax.ensure_compile_time_eval():
        return rngs.params()


def normal_init(rngs: nnx.Rngs, shape, std: float, dtype):
    return (jax.random.normal(param_key(rngs), shape, jnp.float32) * std).astype(dtype)


class Linear(nnx.Module):
    """y = x @ kernel, kernel `[in, out]` (torch stores `[out, in]`). Accumulates in float32, returns x.dtype."""

    def __init__(self, in_features: int, out_features: int, *, rngs: nnx.Rngs, dtype=jnp.float32, std=None):
        std = in_features ** -0.5 if std is None else std
        self.kernel = nnx.Param(normal_init(rngs, (in_features, out_features), std, dtype))

    def __call__(self, x, out_dtype=None):
        return matmul(x.astype(self.kernel.dtype), self.kernel[...]).astype(out_dtype or x.dtype)


class RMSNorm(nnx.Module):
    """weight · x / sqrt(mean(x²) + eps), statistics in float32, result in x.dtype (weight applied after the cast,
    as the reference implementations do)."""

    def __init__(self, dim: int, eps: float, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.eps = eps
        self.weight = nnx.Param((1.0 + 0.1 * jax.random.normal(param_key(rngs), (dim,))).astype(dtype))

    def __call__(self, x, ctx=None):
        """`x [..., dim]`; with a `ForwardContext`, by its norm backend (`sharding.norm`: one GPU kernel at decode)."""
        if ctx is None:
            return rmsnorm(x, self.weight[...], self.eps)
        return sharded_norm.rmsnorm(ctx, x, self.weight[...], self.eps)


class LayerNorm(nnx.Module):
    """LayerNorm with weight and bias, float32 statistics."""

    def __init__(self, dim: int, eps: float, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.eps = eps
        self.weight = nnx.Param((1.0 + 0.1 * jax.random.normal(param_key(rngs), (dim,))).astype(dtype))
        self.bias = nnx.Param((0.1 * jax.random.normal(param_key(rngs), (dim,))).astype(dtype))

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        mu = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mu), axis=-1, keepdims=True)
        y = (xf - mu) * jax.lax.rsqrt(var + self.eps)
        return (y * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


def activation_fn(cfg):
    """The gated activation `act(gate, up)` named by a ModelConfig."""
    if cfg.activation == "situ":
        return lambda g, u: situ(g, u, cfg.situ_beta, cfg.situ_linear_beta)
    if cfg.activation == "swiglu":
        return swiglu
    if cfg.activation == "clamped_swiglu":
        return clamped_swiglu
    raise ValueError(f"unknown activation {cfg.activation!r}")
