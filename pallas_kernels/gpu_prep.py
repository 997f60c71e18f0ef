"""Pure-jnp preparation shared by the GPU decode kernels (DSA indexer, sparse MLA: native Triton and Mosaic GPU):
the tensor-core size rule, the per-head power-of-two normalisation of q, and the hi/lo split of an fp32 operand
into two halves of a 16-bit dot dtype. Everything here runs in XLA, outside the kernels; the kernels' in-kernel
twins live in `triton_codec` (Triton) and `mla.sparse_mgpu` (Mosaic GPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

MIN_DOT = 16  # every tensor-core dot dimension must be ≥ 16 (smaller ones gave wrong results on the H200)


def is_pow2(n: int) -> bool:
    """Whether the int n ≥ 1 is a power of two (Triton block shapes must be)."""
    return n >= 1 and (n & (n - 1)) == 0


def pow2_scale(x, axis=-1):
    """A power of two s ≥ max|x| along `axis` (keepdims; 1 where x is all zero): x / s is in (−1, 1) exactly."""
    m = jnp.max(jnp.abs(x), axis=axis, keepdims=True)
    _, e = jnp.frexp(m)
    return jnp.where(m > 0, jnp.ldexp(jnp.ones_like(m), e), 1.0)


def pow2_at_least(m_f32):
    """m ≥ 0 (f32) -> the power of two 2^(e+1) for m's binary exponent e (> m), 1 where m = 0: `pow2_scale`'s
    ldexp(1, E) for normal m, built from the exponent bits — the same bits as the kernels that normalise q
    themselves (`triton_codec.pow2_at_least`, the Mosaic GPU sparse MLA kernel)."""
    e = (jax.lax.bitcast_convert_type(m_f32, jnp.int32) >> 23) & 0xFF
    return jnp.where(m_f32 > 0, jax.lax.bitcast_convert_type((e + 1) << 23, jnp.float32), 1.0)


def split_hi_lo(x_f32, cdt):
    """x (float32, |x| ≤ 1 after the per-head power-of-two normalisation) -> (hi, lo) in cdt with x ≈ hi + lo:
    ≈ 2^-21 relative for f16, 2^-15 for bf16. For XLA-side code (the q planes built before the kernels).

    hi is x with its mantissa TRUNCATED by an integer mask to cdt's 11 (f16) / 8 (bf16) significant bits, so it is
    exact in cdt and lo = x − hi is exact in f32 (then rounded to cdt). The obvious `lo = x − f32(cdt(x))` is wrong
    on GPU: XLA's default `--xla_allow_excess_precision` (SimplifyFPConversions) removes the convert(convert(x, f16),
    f32) round trip, so lo = 0 and q keeps only cdt's mantissa (openxla/xla#41605; CPU keeps the round trip). That
    was the H200 error of the exact kernels: 1.6e-4 … 2.9e-4 (f16 q) and 2.3e-3 (bf16 q) relative RMS vs ~1e-6 in
    CPU interpret mode. Bit masks cannot be folded. f16: |x| < 2^-14 (f16 subnormal) goes wholly to lo (abs. error
    ≤ 2^-25)."""
    x = jnp.asarray(x_f32, jnp.float32)
    drop = {jnp.dtype(jnp.float16): 13, jnp.dtype(jnp.bfloat16): 16}[jnp.dtype(cdt)]
    mask = jnp.uint32((0xFFFFFFFF << drop) & 0xFFFFFFFF)
    hi32 = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(x, jnp.uint32) & mask, jnp.float32)
    if jnp.dtype(cdt) == jnp.dtype(jnp.float16):
        hi32 = jnp.where(jnp.abs(x) < 2.0 ** -14, 0.0, hi32)
    return hi32.astype(cdt), (x - hi32).astype(cdt)
