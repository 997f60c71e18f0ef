"""Rotary embeddings for the DeepSeek MLA / indexer variants, with YaRN frequency scaling. K3 uses none."""

from __future__ import annotations

import math

import jax.numpy as jnp

from ..config import RopeConfig
from ..config import yarn_mscale


def _yarn_inv_freq(dim: int, rc: RopeConfig):
    base_inv = 1.0 / (rc.theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    if not rc.yarn_factor:
        return base_inv
    factor = rc.yarn_factor

    def correction_dim(num_rot):
        return (dim * math.log(rc.original_max_positions / (num_rot * 2 * math.pi))) / (2 * math.log(rc.theta))

    low, high = correction_dim(rc.beta_fast), correction_dim(rc.beta_slow)
    if rc.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    extrapolation = 1.0 - ramp  # 1 keeps the original frequency
    return base_inv / factor * (1 - extrapolation) + base_inv * extrapolation


def rope_cos_sin(positions_bt, dim: int, rc: RopeConfig):
    """cos, sin `[B, T, dim/2]` float32. YaRN's attention factor is applied to both (as the references do)."""
    inv = _yarn_inv_freq(dim, rc)
    ang = positions_bt.astype(jnp.float32)[..., None] * inv
    att = attention_factor(rc)
    return jnp.cos(ang) * att, jnp.sin(ang) * att


def attention_factor(rc: RopeConfig) -> float:
    """YaRN's cos/sin scale, by the transformers rule (see RopeConfig.attention_factor)."""
    if rc.attention_factor is not None:
        return rc.attention_factor
    if not rc.yarn_factor:
        return 1.0
    if rc.mscale and rc.mscale_all_dim:
        return yarn_mscale(rc.yarn_factor, rc.mscale) / yarn_mscale(rc.yarn_factor, rc.mscale_all_dim)
    return yarn_mscale(rc.yarn_factor, 1.0)


def apply_rope(x_bt_hd, cos_bt, sin_bt, interleaved: bool):
    """Rotate the last axis of x `[B, T, (H,) d]`. interleaved: pairs (0,1),(2,3)…; else halves (i, i+d/2)."""
    xf = x_bt_hd.astype(jnp.float32)
    extra = xf.ndim - 3
    cos = cos_bt.reshape(cos_bt.shape[:2] + (1,) * extra + cos_bt.shape[2:])
    sin = sin_bt.reshape(sin_bt.shape[:2] + (1,) * extra + sin_bt.shape[2:])
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        y1, y2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        y = jnp.stack([y1, y2], axis=-1).reshape(xf.shape)
    else:
        half = xf.shape[-1] // 2
        x1, x2 = xf[..., :half], xf[..., half:]
        y = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return y.astype(x_bt_hd.dtype)
