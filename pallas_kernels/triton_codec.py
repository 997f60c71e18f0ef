"""Triton device functions for the storage codecs, the native kernels' twins of `codec.py` (same values, bit for bit):
e2m1 codes, E8M0 scale bytes, and the power of two a kernel normalises q by. Nothing here is vendor-specific."""

from __future__ import annotations

from .triton_call import jit, tl


@jit
def e2m1_value(code):
    """4-bit e2m1 codes (int32, 0..15) -> float32 by arithmetic (`codec.e2m1_value`): e = 0 -> 0.5·m, else
    2^(e−1)·(1 + m/2)."""
    mag = code & 7
    e = mag >> 1
    m = (mag & 1).to(tl.float32)
    pow2 = ((1 << e) >> 1).to(tl.float32)  # e = 1, 2, 3 -> 1, 2, 4 (e = 0 -> 0, replaced below)
    v = tl.where(e == 0, 0.5 * m, pow2 * (1.0 + 0.5 * m))
    return tl.where((code & 8) != 0, -v, v)


@jit
def e8m0_value(byte):
    """E8M0 scale bytes (int32) -> 2^(byte − 127) float32 from the exponent bits (exact; byte 0 -> 0)."""
    return (byte << 23).to(tl.float32, bitcast=True)


@jit
def pow2_at_least(m):
    """m ≥ 0 (f32) -> 2^(e+1) for m's binary exponent e (> m), 1 where m = 0: `jnp.frexp`'s ldexp(1, E) for normal
    m, as `gpu_prep.pow2_scale` computes it outside the kernels."""
    e = (m.to(tl.int32, bitcast=True) >> 23) & 0xFF
    return tl.where(m > 0, ((e + 1) << 23).to(tl.float32, bitcast=True), 1.0)
