"""Gated expert activations `act(g, u)` on float32 (docs/model.md §7): the definitions the kernels fuse into their
epilogue and the model (`kimi_jax.modules.layers`) uses."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def situ(g, u, beta: float = 4.0, linear_beta: float = 25.0):
    """SiTU (K3): [β·tanh(g/β)·sigmoid(g)] · [β_lin·tanh(u/β_lin)], float32."""
    g = g.astype(jnp.float32)
    u = u.astype(jnp.float32)
    return beta * jnp.tanh(g / beta) * jax.nn.sigmoid(g) * (linear_beta * jnp.tanh(u / linear_beta))


def swiglu(g, u):
    g = g.astype(jnp.float32)
    return jax.nn.silu(g) * u.astype(jnp.float32)


def clamped_swiglu(g, u, limit: float = 10.0):
    g = g.astype(jnp.float32)
    return jax.nn.silu(jnp.minimum(g, limit)) * jnp.clip(u.astype(jnp.float32), -limit, limit)


ACTIVATIONS = {"situ": situ, "swiglu": swiglu, "clamped_swiglu": clamped_swiglu}
