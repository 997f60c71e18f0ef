"""The one codec of the project's narrow number formats: e2m1 (FP4) and E8M0, MXFP4 and NVFP4 blocks, e4m3 (FP8)
elements, FP8 weight blocks and FP8 index-key groups. The kernels decode with it (`e2m1_value` inside kernels,
`mxfp4_dequantize` for the MoE reference), `kimi_jax.quant` stores the caches' rows with it, and `convert` reads and
writes checkpoints' quantised weights with it.

Each format is defined once here. Most functions are jnp (jitted; eager calls compile once per shape); the
checkpoint-side ones are NumPy (`*_np`: convert runs on the host and must not put a checkpoint through a device),
written over the same helpers as their jnp twins (`_e2m1_codes`, `_e8m0_exponents`), so both round alike.

Elements
- e2m1: 4-bit code, bit 3 sign, bits 2..1 exponent (bias 1), bit 0 mantissa: magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}.
  Encoding rounds to nearest, ties to the even code, saturating at ±6; the sign bit is kept, so −0.0 and small
  negatives that round to zero are code 0x8. Two codes per byte, the LOW nibble holding the even element (the
  compressed-tensors order of Kimi K3's checkpoints). Inputs must be finite.
- E8M0 (MX scale byte): 2^(byte − 127); byte 255 is NaN.
- e4m3 (`float8_e4m3fn`, max 448, no inf): round to nearest even, SATURATING: |x| > 448 stores ±448 (a plain cast
  would give NaN). NaN stays NaN.

Blocks
- MXFP4, `[..., n]` (n % 32 == 0) <-> packed uint8 `[..., n/2]` + E8M0 uint8 `[..., n/32]`: per 32 values the scale
  2^e, e = ceil(log2(amax / 6)) (the smallest power of two that maps the group into [−6, 6]: no saturation; OCP MX's
  own rule, e = floor(log2 amax) − 2, would clip the top of the range), e clipped to [−127, 127]; an all-zero group
  gets byte 0. Checkpoints hold weights `[out, in]` grouped along `in`.
- NVFP4, `[..., n]` (n % 16 == 0) <-> packed uint8 `[..., n/2]` + e4m3 `[..., n/16]`: block scale
  s16 = e4m3(amax16 / 6 / s) for a per-tensor float32 scale s; values e2m1(x / (s16·s)) (saturating: the scale
  rounding can push a value up to 6·16/15). A block whose scale underflows e4m3 is zeros. Per-value error ≤ s16·s.
- FP8 weight blocks (DeepSeek-V3.x checkpoints): e4m3 `[..., out, in]` + float32 `scale_inv` per
  `block` = (128, 128) tile `[..., ceil(out/128), ceil(in/128)]`: value = weight · scale_inv of its tile;
  quantising uses scale_inv = amax / 448 (1 for an all-zero tile).
- FP8 index keys: e4m3 of k / sc, one float32 sc per 128 values, sc = max(amax128, 1e-4) / 448 rounded UP to a
  power of two (so k / sc is exact and never exceeds 448); a last partial group is zero-padded.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

MXFP4_GROUP = 32  # elements per E8M0 scale
NVFP4_GROUP = 16  # elements per e4m3 block scale
E2M1_MAX = 6.0  # largest e2m1 magnitude
E8M0_BIAS = 127
E4M3 = jnp.float8_e4m3fn
E4M3_MAX = 448.0
FP8_BLOCK = (128, 128)  # FP8 weight tile of the checkpoints
INDEX_FP8_GROUP = 128
INDEX_FP8_MIN_AMAX = 1e-4

# e2m1 code -> value
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)

# e2m1 rounding thresholds on |x|, paired with whether a value exactly on the threshold moves up. At a midpoint
# the even code wins: 0.25 -> 0 (code 0), 0.75 -> 1 (code 2), 1.25 -> 1 (2), 1.75 -> 2 (4), 2.5 -> 2 (4),
# 3.5 -> 4 (6), 5 -> 4 (6).
_E2M1_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


# ----------------------------------------------------------------------------------------------- shared rules

def _e2m1_codes(xp, x):
    """float32 `x` -> uint8 e2m1 codes (0..15) with array module `xp` (numpy or jax.numpy)."""
    a = xp.abs(x)
    code = xp.zeros(x.shape, xp.uint8)
    for mid, tie_up in _E2M1_MIDPOINTS:
        code = code + (a >= mid if tie_up else a > mid).astype(xp.uint8)
    return code | (xp.signbit(x).astype(xp.uint8) << 3)


def _pow2_ceil_exponent(xp, x):
    """ceil(log2 x) as int32, exactly, for finite x > 0 (via frexp, no log2 rounding)."""
    m, e = xp.frexp(x)
    return xp.where(m == 0.5, e - 1, e).astype(xp.int32)


def _e8m0_exponents(xp, amax):
    """MXFP4 scale exponents e ∈ [−127, 127] of groups with largest magnitude `amax` (−127 for all-zero groups)."""
    e = xp.where(amax > 0, _pow2_ceil_exponent(xp, xp.where(amax > 0, amax, 1.0) / E2M1_MAX), -E8M0_BIAS)
    return xp.clip(e, -E8M0_BIAS, E8M0_BIAS).astype(xp.int32)


def _mxfp4_groups(xp, x):
    """`[..., n]` float32 -> `[..., n/32, 32]`, refusing n that is not whole groups."""
    if x.shape[-1] % MXFP4_GROUP:
        raise ValueError(f"MXFP4 needs a multiple of {MXFP4_GROUP} values, got {x.shape[-1]}")
    return x.reshape(x.shape[:-1] + (x.shape[-1] // MXFP4_GROUP, MXFP4_GROUP))


def _groups(x, group: int):
    """`[..., n]` -> `[..., n/group, group]`, zero-padding the last group when n is not a multiple."""
    n = x.shape[-1]
    pad = -n % group
    if pad:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    return x.reshape(x.shape[:-1] + ((n + pad) // group, group))


# ----------------------------------------------------------------------------------------------- elements (jnp)

def e2m1_value(code_i32):
    """4-bit e2m1 codes (int32, 0..15) -> float32 values by arithmetic (no table, so it lowers inside Pallas
    kernels on every backend): e = 0 -> 0.5·m, else 2^(e−1)·(1 + m/2)."""
    mag = code_i32 & 7
    e = mag >> 1
    m = (mag & 1).astype(jnp.float32)
    pow2 = ((1 << e) >> 1).astype(jnp.float32)  # e = 1, 2, 3 -> 1, 2, 4 (e = 0 -> 0, replaced below)
    v = jnp.where(e == 0, 0.5 * m, pow2 * (1.0 + 0.5 * m))
    return jnp.where((code_i32 & 8) != 0, -v, v)


def e8m0_value(byte_i32):
    """E8M0 scale bytes (int32) -> 2^(byte − 127) float32, built from the exponent bits (exact, lowers inside Pallas
    kernels; byte 0 -> 0, byte 255 -> inf, unlike `mxfp4_dequantize`'s NaN)."""
    return jax.lax.bitcast_convert_type(byte_i32 << 23, jnp.float32)


@jax.jit
def to_e4m3(x):
    """Saturating round-to-nearest-even cast to float8_e4m3fn (|x| > 448 -> ±448; NaN stays NaN)."""
    return jnp.clip(jnp.asarray(x, jnp.float32), -E4M3_MAX, E4M3_MAX).astype(E4M3)


@jax.jit
def e2m1_encode(x):
    """float -> uint8 e2m1 codes (0..15): nearest, ties to even, saturating at ±6, sign kept (−0 -> 0x8)."""
    return _e2m1_codes(jnp, jnp.asarray(x, jnp.float32))


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
    """The smallest power of two ≥ x, exactly, for finite x > 0."""
    x = jnp.asarray(x, jnp.float32)
    return jnp.ldexp(jnp.ones_like(x), _pow2_ceil_exponent(jnp, x))


# ----------------------------------------------------------------------------------------------- blocks (jnp)

@jax.jit
def mxfp4_quantize(x):
    """`[..., n]` (n % 32 == 0) -> (packed uint8 `[..., n/2]`, E8M0 uint8 `[..., n/32]`)."""
    g = _mxfp4_groups(jnp, jnp.asarray(x, jnp.float32))
    e = _e8m0_exponents(jnp, jnp.max(jnp.abs(g), axis=-1))
    codes = _e2m1_codes(jnp, jnp.ldexp(g, -e[..., None])).reshape(g.shape[:-2] + (-1,))
    return pack_nibbles(codes), (e + E8M0_BIAS).astype(jnp.uint8)


@jax.jit
def mxfp4_dequantize(packed, e8m0):
    """(packed uint8 `[..., n/2]`, E8M0 uint8 `[..., n/32]`) -> float32 `[..., n]` (NaN where a scale is 255)."""
    vals = e2m1_decode(unpack_nibbles(packed))
    g = vals.reshape(vals.shape[:-1] + (vals.shape[-1] // MXFP4_GROUP, MXFP4_GROUP))
    e = e8m0.astype(jnp.int32) - E8M0_BIAS
    g = jnp.where((e8m0 == 255)[..., None], jnp.nan, jnp.ldexp(g, e[..., None]))
    return g.reshape(vals.shape)


@jax.jit
def nvfp4_quantize(x, scale=1.0):
    """`[..., n]` (n % 16 == 0) -> (packed uint8 `[..., n/2]`, e4m3 block scales `[..., n/16]`).
    Values are x / scale before blocking (`scale`: the per-tensor float32 scale)."""
    x = jnp.asarray(x, jnp.float32) / scale
    if x.shape[-1] % NVFP4_GROUP:
        raise ValueError(f"NVFP4 needs a multiple of {NVFP4_GROUP} values, got {x.shape[-1]}")
    g = _groups(x, NVFP4_GROUP)
    s8 = to_e4m3(jnp.max(jnp.abs(g), axis=-1) / E2M1_MAX)
    s = s8.astype(jnp.float32)[..., None]
    y = jnp.where(s > 0, g / jnp.where(s > 0, s, 1.0), 0.0)
    codes = _e2m1_codes(jnp, y).reshape(x.shape)
    return pack_nibbles(codes), s8


@jax.jit
def nvfp4_dequantize(packed, block_scales, scale=1.0):
    """(packed uint8 `[..., n/2]`, e4m3 `[..., n/16]`) -> float32 `[..., n]`, times the per-tensor `scale`."""
    vals = e2m1_decode(unpack_nibbles(packed))
    g = vals.reshape(vals.shape[:-1] + (vals.shape[-1] // NVFP4_GROUP, NVFP4_GROUP))
    g = g * block_scales.astype(jnp.float32)[..., None]
    return g.reshape(vals.shape) * scale


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
    """(e4m3 `[..., n]`, float32 `[..., ceil(n/128)]`) -> float32 `[..., n]`."""
    n = codes.shape[-1]
    g = _groups(codes.astype(jnp.float32), INDEX_FP8_GROUP) * scales[..., None]
    return g.reshape(g.shape[:-2] + (-1,))[..., :n]


# ----------------------------------------------------------------------------------------------- checkpoints (NumPy)

def mxfp4_quantize_np(w) -> tuple[np.ndarray, np.ndarray]:
    """`mxfp4_quantize` on the host: float `[..., n]` (n % 32 == 0) -> (packed uint8 `[..., n/2]`, E8M0 uint8
    `[..., n/32]`), bit for bit the same."""
    g = _mxfp4_groups(np, np.asarray(w, np.float32))
    e = _e8m0_exponents(np, np.abs(g).max(axis=-1))
    codes = _e2m1_codes(np, np.ldexp(g, -e[..., None]).astype(np.float32)).reshape(g.shape[:-2] + (-1,))
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8), (e + E8M0_BIAS).astype(np.uint8)


def mxfp4_dequantize_np(packed_u8, scale_u8) -> np.ndarray:
    """`mxfp4_dequantize` on the host: packed uint8 `[..., n/2]`, E8M0 uint8 `[..., n/32]` -> float32 `[..., n]`
    (shapes are the caller's to check)."""
    packed_u8 = np.asarray(packed_u8, np.uint8)
    scale_u8 = np.asarray(scale_u8, np.uint8)
    codes = np.stack([packed_u8 & 0x0F, packed_u8 >> 4], axis=-1).reshape(packed_u8.shape[:-1] + (-1,))
    g = E2M1_VALUES[codes].reshape(scale_u8.shape + (MXFP4_GROUP,))
    g = np.where((scale_u8 == 255)[..., None], np.float32(np.nan),
                 np.ldexp(g, scale_u8.astype(np.int32)[..., None] - E8M0_BIAS).astype(np.float32))
    return g.reshape(codes.shape)


def fp8_block_scale_shape(shape, block=FP8_BLOCK) -> tuple:
    """The scale grid of a `[..., out, in]` FP8 weight."""
    *lead, rows, cols = shape
    return tuple(lead) + (-(-rows // block[0]), -(-cols // block[1]))


def _expand_blocks(scale, rows, cols, block):
    s = np.repeat(np.repeat(scale, block[0], axis=-2), block[1], axis=-1)
    return s[..., :rows, :cols]


def fp8_block_dequantize_np(weight, scale_inv, block=FP8_BLOCK, out_dtype=np.float32) -> np.ndarray:
    """`[..., out, in]` FP8 weight times its tile's scale_inv -> `out_dtype` (math in float32; the scale grid must
    be `fp8_block_scale_shape(weight.shape, block)`)."""
    rows, cols = weight.shape[-2:]
    w = np.asarray(weight).astype(np.float32)
    w *= _expand_blocks(np.asarray(scale_inv, np.float32), rows, cols, block)
    return w.astype(out_dtype, copy=False)


def fp8_block_quantize_np(w, block=FP8_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """`[..., out, in]` -> (float8_e4m3fn weight, float32 scale_inv `fp8_block_scale_shape`), scale = amax / 448."""
    w = np.asarray(w, np.float32)
    rows, cols = w.shape[-2:]
    pr, pc = -rows % block[0], -cols % block[1]
    pad = [(0, 0)] * (w.ndim - 2) + [(0, pr), (0, pc)]
    wp = np.pad(np.abs(w), pad)
    g = wp.reshape(*w.shape[:-2], (rows + pr) // block[0], block[0], (cols + pc) // block[1], block[1])
    amax = g.max(axis=(-3, -1))
    scale = np.where(amax > 0, amax / E4M3_MAX, 1.0).astype(np.float32)
    q = np.clip(w / _expand_blocks(scale, rows, cols, block), -E4M3_MAX, E4M3_MAX).astype(E4M3)
    return q, scale
