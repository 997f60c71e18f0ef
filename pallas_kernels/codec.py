"""The e2m1 / MXFP4 codec in NumPy: the one definition of the format that the kernels decode and `convert` reads and
writes (checkpoints of Kimi K3's routed experts, compressed-tensors `mxfp4-pack-quantized`).

Layout `[..., out, in]` values <-> packed uint8 `[..., out, in/2]` (two e2m1 codes per byte, the LOW nibble holding
the even element) and E8M0 uint8 scales `[..., out, in/32]`: value = e2m1 · 2^(s − 127), s = 255 is NaN.
The module imports NumPy only, so `convert` can import it cheaply; `e2m1_value` is the table-free jnp decode the
kernels trace (jax is imported when it is called). The jnp block formats built on these (NVFP4, MXFP4, fp8 caches)
are `kimi_jax.quant`'s; the kernels' PTX decodes are `pallas_kernels.moe.mxfp4`'s, tested against this table.
"""

from __future__ import annotations

import numpy as np

MXFP4_GROUP = 32  # elements per E8M0 scale
E2M1_MAX = 6.0  # largest e2m1 magnitude
E8M0_BIAS = 127

# e2m1 code -> value: bit 3 sign, bits 2..1 exponent (bias 1), bit 0 mantissa
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def e2m1_value(code_i32):
    """4-bit e2m1 codes (int32, 0..15) -> float32 values by arithmetic (no table, so it lowers inside Pallas
    kernels on every backend): bit 3 sign, bits 2..1 exponent e (bias 1), bit 0 mantissa m: e = 0 -> 0.5·m,
    else 2^(e−1)·(1 + m/2)."""
    import jax.numpy as jnp  # noqa: PLC0415  (this module stays NumPy-only at import time)

    mag = code_i32 & 7
    e = mag >> 1
    m = (mag & 1).astype(jnp.float32)
    pow2 = ((1 << e) >> 1).astype(jnp.float32)  # e = 1, 2, 3 -> 1, 2, 4 (e = 0 -> 0, replaced below)
    v = jnp.where(e == 0, 0.5 * m, pow2 * (1.0 + 0.5 * m))
    return jnp.where((code_i32 & 8) != 0, -v, v)


def mxfp4_decode(packed_u8, scale_u8) -> np.ndarray:
    """Packed codes `[..., out, in/2]` uint8 and E8M0 scales `[..., out, in/32]` uint8 -> float32 `[..., out, in]`
    (shapes are the caller's to check)."""
    packed_u8 = np.asarray(packed_u8, np.uint8)
    scale_u8 = np.asarray(scale_u8, np.uint8)
    cols = packed_u8.shape[-1] * 2
    codes = np.empty(packed_u8.shape[:-1] + (cols,), np.uint8)
    codes[..., 0::2] = packed_u8 & 0x0F  # low nibble: even element
    codes[..., 1::2] = packed_u8 >> 4
    vals = E2M1_VALUES[codes]
    mult = np.ldexp(np.float32(1.0), scale_u8.astype(np.int32) - 127).astype(np.float32)
    mult[scale_u8 == 255] = np.nan
    vals = vals.reshape(scale_u8.shape + (MXFP4_GROUP,)) * mult[..., None]
    return vals.reshape(codes.shape)


def mxfp4_encode(w) -> tuple[np.ndarray, np.ndarray]:
    """float `[..., out, in]` (in a multiple of 32) -> (packed uint8 `[..., out, in/2]`, E8M0 uint8 `[..., out, in/32]`):
    per 32 values the power-of-two scale that maps the group's largest magnitude into [0, 6], then round to the
    nearest e2m1 value (ties to the smaller magnitude)."""
    w = np.asarray(w, np.float32)
    cols = w.shape[-1]
    if cols % MXFP4_GROUP:
        raise ValueError(f"MXFP4 needs the input dimension to be a multiple of {MXFP4_GROUP}, got {cols}")
    g = w.reshape(w.shape[:-1] + (cols // MXFP4_GROUP, MXFP4_GROUP))
    amax = np.abs(g).max(axis=-1)
    e = np.where(amax > 0, np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)), -127).astype(np.int32)
    e = np.clip(e, -127, 127)
    x = g / np.ldexp(np.float32(1.0), e)[..., None]
    mags = E2M1_VALUES[:8]
    dist = np.abs(np.abs(x)[..., None] - mags)  # nearest magnitude; argmin keeps the smaller one on ties
    code = np.argmin(dist, axis=-1).astype(np.uint8)
    code |= np.where(np.signbit(x) & (code > 0), 8, 0).astype(np.uint8)
    code = code.reshape(w.shape)
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).astype(np.uint8)
    return packed, (e + 127).astype(np.uint8)
