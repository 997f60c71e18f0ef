"""Cache quantisation formats (SPEC §6, §10): quantise on write, dequantise in the ops. Pure jnp, jit-friendly
(the functions are jitted themselves, so eager calls compile once per shape; inside a jit they inline).

Every format stores one token's row as a few fixed-width parts (arrays `[..., width]`); the bytes of those parts per
token are exactly `kimi_jax.cache`'s figures (`LatentFormat.bytes_per_token`, checked by `check_against_cache`).

Element encodings
- e4m3 (`float8_e4m3fn`, max 448, no inf): round to nearest even, SATURATING: |x| > 448 stores ±448 (a plain cast
  would give NaN). NaN stays NaN.
- e2m1 (FP4, 4-bit code: bit 3 sign, bits 2..1 exponent (bias 1), bit 0 mantissa; magnitudes
  {0, .5, 1, 1.5, 2, 3, 4, 6}): round to nearest, ties to the even code, saturating at ±6. The sign bit is kept,
  so −0.0 and small negatives that round to zero are stored as code 0x8 (−0). Two codes per byte, the LOW nibble
  holding the even element (the compressed-tensors / `convert.quant` order). Inputs must be finite.
- E8M0 (MX scale byte): 2^(byte − 127).

Latent rows `[lat (R) | k_rope (rope)]` (576 values at full size), one set of parts per token:
- "fp32":  float32 values (unquantised; float32 models and references)      4·(R + rope) B (2304)
- "bf16":  bf16 values                                                   2·(R + rope) B (1152)
- "fp8":   e4m3 of x / s for all R + rope values                          R + rope B     (576)
- "nvfp4": packed e2m1 of the latent, R/2 B; one e4m3 scale per 16 latent values, R/16 B; the rope part as e4m3
           of x / s, rope B                                                 (256 + 32 + 64 = 352)
  `s` is ONE float32 scale per layer (per pool), default 1.0, not per token: that is what keeps the row at exactly
  R + rope bytes. The latent is RMS-normed (|x| ≲ √R·|γ| ≈ 23·|γ|) and k_rope is O(1–10), well inside e4m3's range, so
  s = 1 already works; a calibrated s (e.g. amax / 448 over a calibration set) can be stored in the pool without
  changing the layout. A per-token scale would cost 4 B per scale per token: one fp32 per 128 values would make the
  row 576 + 20 = 596 B (FlashMLA's DeepSeek-V3.2 layout, 512 e4m3 + 4 fp32 + 64 bf16 rope, is 656 B).
  NVFP4 block scale: s16 = e4m3(amax16 / 6 / s) (round to nearest even, saturating at 448); the 16 values are then
  coded as e2m1(x / (s16·s)) with saturation (the scale rounding can push a value up to 6·16/15 before it is clipped
  to 6). A block whose scale underflows e4m3 (amax16 / s ≤ 6·2^-10) is stored as zeros. Per-value error ≤ s16·s.

Index keys (one key of d values per token):
- "fp32":  float32 values                                                4·d B
- "bf16":  bf16 values                                                   2·d B
- "fp8":   e4m3 of k / sc, one fp32 sc per 128 values; sc = max(amax128, 1e-4) / 448 rounded UP to a power of two
           (so k / sc is exact and never exceeds 448)                       d + 4·ceil(d/128) B (132)
- "mxfp4": packed e2m1, one E8M0 scale per 32 values: 2^e with e = ceil(log2(amax32 / 6)) (the smallest power of
           two that maps the group into [−6, 6], no saturation), e clipped to [−127, 127]; an all-zero group gets
           byte 0                                                           d/2 + d/32 B   (68)
  (OCP MX's own rule, e = floor(log2 amax) − 2, saturates the top of the range; this one never clips; it is the
  rule `convert.quant.mxfp4_quant` uses, with ties to even instead of ties to the smaller magnitude.)

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

from pallas_kernels.codec import E2M1_MAX, E2M1_VALUES, E8M0_BIAS, MXFP4_GROUP  # noqa: F401  (one codec)

from .cache import INDEX_DTYPES, KV_DTYPES, index_key_bytes_per_token, latent_bytes_per_token

E4M3 = jnp.float8_e4m3fn
E4M3_MAX = 448.0
NVFP4_GROUP = 16
INDEX_FP8_GROUP = 128
INDEX_FP8_MIN_AMAX = 1e-4

# e2m1 rounding thresholds on |x|, paired with whether a value exactly on the threshold moves up. At a midpoint
# the even code wins: 0.25 -> 0 (code 0), 0.75 -> 1 (code 2), 1.25 -> 1 (2), 1.75 -> 2 (4), 2.5 -> 2 (4),
# 3.5 -> 4 (6), 5 -> 4 (6).
_E2M1_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


# ----------------------------------------------------------------------------------------------- element codecs

@jax.jit
def to_e4m3(x):
    """Saturating round-to-nearest-even cast to float8_e4m3fn (|x| > 448 -> ±448; NaN stays NaN)."""
    return jnp.clip(jnp.asarray(x, jnp.float32), -E4M3_MAX, E4M3_MAX).astype(E4M3)


@jax.jit
def e2m1_encode(x):
    """float -> uint8 e2m1 codes (0..15): nearest, ties to even, saturating at ±6, sign kept (−0 -> 0x8)."""
    x = jnp.asarray(x, jnp.float32)
    a = jnp.abs(x)
    code = jnp.zeros(x.shape, jnp.uint8)
    for mid, tie_up in _E2M1_MIDPOINTS:
        code = code + (a >= mid if tie_up else a > mid).astype(jnp.uint8)
    return code | (jnp.signbit(x).astype(jnp.uint8) << 3)


@jax.jit
def e2m1_decode(codes):
    """uint8 e2m1 codes -> float32 values."""
    return jnp.asarray(E2M1_VALUES)[jnp.asarray(codes).astype(jnp.int32) & 0xF]


@jax.jit
def pack_nibbles(codes):
    """`[..., 2n]` 4-bit codes -> `[..., n]` uint8, the low nibble holding the even element."""
    codes = jnp.asarray(codes, jnp.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


@jax.jit
def unpack_nibbles(packed):
    """`[..., n]` uint8 -> `[..., 2n]` 4-bit codes (even element from the low nibble)."""
    packed = jnp.asarray(packed, jnp.uint8)
    pair = jnp.stack([packed & 0x0F, packed >> 4], axis=-1)
    return pair.reshape(packed.shape[:-1] + (2 * packed.shape[-1],))


@jax.jit
def pow2_ceil(x):
    """The smallest power of two ≥ x, exactly, for finite x > 0 (via frexp, no log2 rounding)."""
    m, e = jnp.frexp(jnp.asarray(x, jnp.float32))
    return jnp.ldexp(jnp.ones_like(m), jnp.where(m == 0.5, e - 1, e))


@jax.jit
def pow2_ceil_exponent(x):
    """ceil(log2 x) as int32, exactly, for finite x > 0."""
    m, e = jnp.frexp(jnp.asarray(x, jnp.float32))
    return jnp.where(m == 0.5, e - 1, e).astype(jnp.int32)


def _groups(x, group: int):
    """`[..., n]` -> `[..., n/group, group]`, zero-padding the last group when n is not a multiple."""
    n = x.shape[-1]
    pad = -n % group
    if pad:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    return x.reshape(x.shape[:-1] + ((n + pad) // group, group))


# ----------------------------------------------------------------------------------------------- block formats

@jax.jit
def nvfp4_quantize(x, scale=1.0):
    """`[..., n]` (n % 16 == 0) -> (packed uint8 `[..., n/2]`, e4m3 block scales `[..., n/16]`).
    Values are x / scale before blocking (`scale`: the per-layer float32 tensor scale)."""
    x = jnp.asarray(x, jnp.float32) / scale
    if x.shape[-1] % NVFP4_GROUP:
        raise ValueError(f"NVFP4 needs a multiple of {NVFP4_GROUP} values, got {x.shape[-1]}")
    g = _groups(x, NVFP4_GROUP)
    s8 = to_e4m3(jnp.max(jnp.abs(g), axis=-1) / E2M1_MAX)
    s = s8.astype(jnp.float32)[..., None]
    y = jnp.where(s > 0, g / jnp.where(s > 0, s, 1.0), 0.0)
    codes = e2m1_encode(y).reshape(x.shape)
    return pack_nibbles(codes), s8


@jax.jit
def nvfp4_dequantize(packed, block_scales, scale=1.0):
    vals = e2m1_decode(unpack_nibbles(packed))
    g = vals.reshape(vals.shape[:-1] + (vals.shape[-1] // NVFP4_GROUP, NVFP4_GROUP))
    g = g * block_scales.astype(jnp.float32)[..., None]
    return g.reshape(vals.shape) * scale


@jax.jit
def mxfp4_quantize(x):
    """`[..., n]` (n % 32 == 0) -> (packed uint8 `[..., n/2]`, E8M0 uint8 `[..., n/32]`)."""
    x = jnp.asarray(x, jnp.float32)
    if x.shape[-1] % MXFP4_GROUP:
        raise ValueError(f"MXFP4 needs a multiple of {MXFP4_GROUP} values, got {x.shape[-1]}")
    g = _groups(x, MXFP4_GROUP)
    amax = jnp.max(jnp.abs(g), axis=-1)
    e = jnp.where(amax > 0, pow2_ceil_exponent(jnp.where(amax > 0, amax, 1.0) / E2M1_MAX), -E8M0_BIAS)
    e = jnp.clip(e, -E8M0_BIAS, E8M0_BIAS)
    y = jnp.ldexp(g, -e[..., None])
    codes = e2m1_encode(y).reshape(x.shape)
    return pack_nibbles(codes), (e + E8M0_BIAS).astype(jnp.uint8)


@jax.jit
def mxfp4_dequantize(packed, e8m0):
    vals = e2m1_decode(unpack_nibbles(packed))
    g = vals.reshape(vals.shape[:-1] + (vals.shape[-1] // MXFP4_GROUP, MXFP4_GROUP))
    e = e8m0.astype(jnp.int32) - E8M0_BIAS
    g = jnp.where((e8m0 == 255)[..., None], jnp.nan, jnp.ldexp(g, e[..., None]))
    return g.reshape(vals.shape)


@jax.jit
def index_fp8_scales(x):
    """Per-128 scales `[..., ceil(n/128)]` float32: max(amax, 1e-4) / 448 rounded up to a power of two."""
    amax = jnp.max(jnp.abs(_groups(jnp.asarray(x, jnp.float32), INDEX_FP8_GROUP)), axis=-1)
    return pow2_ceil(jnp.maximum(amax, INDEX_FP8_MIN_AMAX) / E4M3_MAX)


@jax.jit
def index_fp8_quantize(x):
    """`[..., n]` -> (e4m3 `[..., n]`, float32 scales `[..., ceil(n/128)]`)."""
    x = jnp.asarray(x, jnp.float32)
    sc = index_fp8_scales(x)
    g = _groups(x, INDEX_FP8_GROUP) / sc[..., None]
    codes = to_e4m3(g).reshape(g.shape[:-2] + (-1,))[..., : x.shape[-1]]
    return codes, sc


@jax.jit
def index_fp8_dequantize(codes, scales):
    n = codes.shape[-1]
    g = _groups(codes.astype(jnp.float32), INDEX_FP8_GROUP) * scales[..., None]
    return g.reshape(g.shape[:-2] + (-1,))[..., :n]


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


__all__ = [
    "E2M1_VALUES", "E4M3", "E4M3_MAX", "IndexKeyFormat", "LatentFormat", "Part", "check_against_cache",
    "e2m1_decode", "e2m1_encode", "fake_quant_index_fp8", "hadamard", "index_fp8_dequantize", "index_fp8_quantize",
    "index_fp8_scales", "mxfp4_dequantize", "mxfp4_quantize", "nvfp4_dequantize", "nvfp4_quantize", "pack_nibbles",
    "pow2_ceil", "round_trip", "to_e4m3", "unpack_nibbles", "KV_DTYPES", "INDEX_DTYPES",
]
