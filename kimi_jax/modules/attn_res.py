"""Block Attention Residuals (AttnRes, docs/model.md §3): the residual stream as a learned softmax mix over block
sums."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from .layers import normal_init, param_key


class AttnResMix(nnx.Module):
    """mix(sources): softmax over sources of ⟨rmsnorm(v_s) (no weight), norm.weight · proj.weight⟩, then Σ p_s v_s.

    Parameters keep the checkpoint's two vectors (`norm_weight`, `proj_weight`, both `[D]`); their product is the
    pseudo-query. Sources `[S, ..., D]`; scores and softmax in float32; the mix of the un-normalised sources is
    returned in their dtype.
    """

    def __init__(self, dim: int, eps: float, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.eps = eps
        self.norm_weight = nnx.Param((1.0 + 0.1 * jax.random.normal(param_key(rngs), (dim,))).astype(dtype))
        self.proj_weight = nnx.Param(normal_init(rngs, (dim,), dim ** -0.5, dtype))

    def __call__(self, sources):
        v = jnp.stack(sources) if isinstance(sources, (list, tuple)) else sources
        if v.shape[0] == 1:
            return v[0]
        vf = v.astype(jnp.float32)
        k = vf * jax.lax.rsqrt(jnp.mean(vf * vf, axis=-1, keepdims=True) + self.eps)
        w = self.norm_weight[...].astype(jnp.float32) * self.proj_weight[...].astype(jnp.float32)
        p = jax.nn.softmax(jnp.sum(k * w, axis=-1), axis=0)  # [S, ...]
        return jnp.sum(p[..., None] * vf, axis=0).astype(v.dtype)
