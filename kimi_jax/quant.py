"""Cache storage formats (docs/model.md §6, §10): quantise on write, dequantise in the ops. Pure jnp, jit-friendly.
The element and block encodings (e4m3, e2m1, NVFP4, MXFP4, FP8 index groups) are `pallas_kernels.codec`'s.

Every format stores one token's row as a few fixed-width parts (arrays `[..., width]`); the bytes of those parts per
token are exactly `kimi_jax.cache`'s figures (`LatentFormat.bytes_per_token`, checked by `check_against_cache`).

Latent rows `[lat (R) | k_rope (rope)]` (576 values at full size), one set of parts per token:
- "fp32":  float32 values (unquantised; float32 models and references)      4·(R + rope) B (2304)
- "bf16":  bf16 values                                                   2·(R + rope) B (1152)
- "fp8":   e4m3 of x / s for all R + rope values                          R + rope B     (576)
- "nvfp4": NVFP4 of the latent (packed e2m1, R/2 B; one e4m3 scale per 16 values, R/16 B); the rope part as e4m3 of
           x / s, rope B                                                    (256 + 32 + 64 = 352)
  `s` is ONE float32 scale per layer (per pool), default 1.0, not per token: that is what keeps the row at exactly
  R + rope bytes. The latent is RMS-normed (|x| ≲ √R·|γ| ≈ 23·|γ|) and k_rope is O(1–10), well inside e4m3's range, so
  s = 1 already works; a calibrated s (e.g. amax / 448 over a calibration set) can be stored in the pool without
  changing the layout. A per-token scale would cost 4 B per scale per token: one fp32 per 128 values would make the
  row 576 + 20 = 596 B (FlashMLA's DeepSeek-V3.2 layout, 512 e4m3 + 4 fp32 + 64 bf16 rope, is 656 B).

Index keys (one key of d values per token):
- "fp32":  float32 values                                                4·d B
- "bf16":  bf16 values                                                   2·d B
- "fp8":   the codec's FP8 index groups: e4m3 + one fp32 scale per 128 values   d + 4·ceil(d/128) B (132)
- "mxfp4": MXFP4: packed e2m1 + one E8M0 scale per 32 values              d/2 + d/32 B   (68)

The queries of FP8 index scoring as deployed go through the same per-128 FP8 rounding; `fake_quant_index_fp8`
models that for a caller, but the model's indexer scores exact queries against the dequantised keys (only the
keys are stored in the cache format). Both q and k may be rotated by a Hadamard transform first (`hadamard`,
`IndexerConfig.hadamard_rotate`; rotate both or neither).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.codec import (E4M3, MXFP4_GROUP, NVFP4_GROUP, INDEX_FP8_GROUP, index_fp8_dequantize,
                                  index_fp8_quantize, mxfp4_dequantize, mxfp4_quantize, nvfp4_dequantize,
                                  nvfp4_quantize, to_e4m3)

from .cache import index_key_bytes_per_token, latent_bytes_per_token


@jax.jit
def fake_quant_index_fp8(x):
    """x rounded through the index FP8 format (what FP8 scoring does to the queries)."""
    return index_fp8_dequantize(*index_fp8_quantize(x)).astype(jnp.asarray(x).dtype)


@jax.jit
def hadamard(x):
    """Orthonormal Walsh–Hadamard transform over the last axis (a power of two): H·x / sqrt(n). Dot products
    between two rotated vectors equal the unrotated ones; the rotation spreads outliers before FP8 rounding."""
    x = jnp.asarray(x)
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"hadamard needs a power-of-two length, got {n}")
    y = x.astype(jnp.float32)
    h = 1
    while h < n:
        y = y.reshape(y.shape[:-1] + (n // (2 * h), 2, h))
        a, b = y[..., 0, :], y[..., 1, :]
        y = jnp.stack([a + b, a - b], axis=-2).reshape(y.shape[:-3] + (n,))
        h *= 2
    return (y * (n ** -0.5)).astype(x.dtype)


# ----------------------------------------------------------------------------------------------- row formats

@dataclass(frozen=True)
class Part:
    """One fixed-width array of a stored row: `[..., width]` of `dtype`."""

    name: str
    width: int
    dtype: np.dtype

    @property
    def bytes_per_token(self) -> int:
        return self.width * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class LatentFormat:
    """Stored form of the MLA latent row `[lat (R) | k_rope (rope)]`; see the module doc. Hashable, so it can be a
    static argument. `dequantize(parts, scale)` takes the per-layer scale (ignored by bf16)."""

    kv_dtype: str
    latent: int
    rope: int

    def __post_init__(self):
        latent_bytes_per_token(self.latent, self.rope, self.kv_dtype)  # validates the name and widths

    @property
    def width(self) -> int:
        return self.latent + self.rope

    @property
    def parts(self) -> tuple[Part, ...]:
        R, r = self.latent, self.rope
        if self.kv_dtype == "fp32":
            return (Part("rows", R + r, np.dtype(np.float32)),)
        if self.kv_dtype == "bf16":
            return (Part("rows", R + r, np.dtype(jnp.bfloat16)),)
        if self.kv_dtype == "fp8":
            return (Part("rows", R + r, np.dtype(E4M3)),)
        return (Part("packed", R // 2, np.dtype(np.uint8)), Part("scales", R // NVFP4_GROUP, np.dtype(E4M3)),
                Part("rope", r, np.dtype(E4M3)))

    @property
    def bytes_per_token(self) -> int:
        return sum(p.bytes_per_token for p in self.parts)

    @partial(jax.jit, static_argnums=0)
    def quantize(self, rows, scale=1.0) -> tuple:
        rows = jnp.asarray(rows)
        if rows.shape[-1] != self.width:
            raise ValueError(f"latent rows must be [..., {self.width}], got {rows.shape}")
        if self.kv_dtype in ("fp32", "bf16"):  # unscaled, like the contiguous cache in that dtype
            return (rows.astype(self.parts[0].dtype),)
        x = rows.astype(jnp.float32)
        if self.kv_dtype == "fp8":
            return (to_e4m3(x / scale),)
        packed, s16 = nvfp4_quantize(x[..., : self.latent], scale)
        return packed, s16, to_e4m3(x[..., self.latent:] / scale)

    @partial(jax.jit, static_argnums=0)
    def dequantize(self, parts, scale=1.0):
        if self.kv_dtype in ("fp32", "bf16"):
            return parts[0].astype(jnp.float32)
        if self.kv_dtype == "fp8":
            return parts[0].astype(jnp.float32) * scale
        packed, s16, rope = parts
        return jnp.concatenate([nvfp4_dequantize(packed, s16, scale), rope.astype(jnp.float32) * scale], axis=-1)


@dataclass(frozen=True)
class IndexKeyFormat:
    """Stored form of the DSA index key (d values); see the module doc. Keys carry their own scales, so
    `dequantize(parts, scale)` ignores `scale` (present so both formats share one call shape)."""

    index_dtype: str
    dim: int

    def __post_init__(self):
        index_key_bytes_per_token(self.dim, self.index_dtype)

    @property
    def width(self) -> int:
        return self.dim

    @property
    def parts(self) -> tuple[Part, ...]:
        d = self.dim
        if self.index_dtype == "fp32":
            return (Part("keys", d, np.dtype(np.float32)),)
        if self.index_dtype == "bf16":
            return (Part("keys", d, np.dtype(jnp.bfloat16)),)
        if self.index_dtype == "fp8":
            return (Part("codes", d, np.dtype(E4M3)), Part("scale", -(-d // INDEX_FP8_GROUP), np.dtype(np.float32)))
        return (Part("packed", d // 2, np.dtype(np.uint8)), Part("scale", d // MXFP4_GROUP, np.dtype(np.uint8)))

    @property
    def bytes_per_token(self) -> int:
        return sum(p.bytes_per_token for p in self.parts)

    @partial(jax.jit, static_argnums=0)
    def quantize(self, keys, scale=None) -> tuple:
        keys = jnp.asarray(keys)
        if keys.shape[-1] != self.dim:
            raise ValueError(f"index keys must be [..., {self.dim}], got {keys.shape}")
        if self.index_dtype in ("fp32", "bf16"):
            return (keys.astype(self.parts[0].dtype),)
        if self.index_dtype == "fp8":
            return index_fp8_quantize(keys)
        return mxfp4_quantize(keys)

    @partial(jax.jit, static_argnums=0)
    def dequantize(self, parts, scale=None):
        if self.index_dtype in ("fp32", "bf16"):
            return parts[0].astype(jnp.float32)
        if self.index_dtype == "fp8":
            return index_fp8_dequantize(*parts)
        return mxfp4_dequantize(*parts)


def check_against_cache(fmt) -> None:
    """Raise unless the format's parts hold exactly `kimi_jax.cache`'s bytes per token."""
    if isinstance(fmt, LatentFormat):
        want = latent_bytes_per_token(fmt.latent, fmt.rope, fmt.kv_dtype)
    else:
        want = index_key_bytes_per_token(fmt.dim, fmt.index_dtype)
    if fmt.bytes_per_token != want:
        raise AssertionError(f"{fmt} stores {fmt.bytes_per_token} B/token but kimi_jax.cache says {want}")


@partial(jax.jit, static_argnums=0)
def round_trip(fmt, x, scale=1.0):
    """x through the format and back (float32) — for error checks and for feeding a reference the stored values."""
    return fmt.dequantize(fmt.quantize(x, scale), scale)
