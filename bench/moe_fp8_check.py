"""Checks of the MXFP4 kernel's fp8 tensor-core path (`dequant="fp8"`) on the GPU, piece by piece.

    python3 bench/moe_fp8_check.py

1. Two fp8 dots chained through the accumulator (x's hi and lo planes) against their exact sum, and x's split into
   e4m3 planes on this device.
2. The kernel with only x's hi plane, only its lo plane, and the split under jit against eager.
3. `triton_prims.fp8_dot_nt` alone on e4m3 operands holding only normal numbers, and with subnormal ones (the shift
   decode's ±0.5 codes are e4m3 subnormals).
4. The grouped matmul (asm_sign, fp8) against ragged_dot on the dequantised weights: random codes, and codes
   without the ±0.5 magnitudes (no subnormal weights).

What it found on the H200: the tensor cores take subnormal codes exactly
(2.7e-5 either way); the 2.7e-2 error of the first version was x's lo plane coming out as zeros — inside a jit, XLA
on the GPU folded the e4m3 convert pair of the split — fixed with `reduce_precision` (both planes 2.3e-5 now).
"""

from __future__ import annotations

import functools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402

from pallas_kernels.moe import gpu, mxfp4 as mx, reference  # noqa: E402
from pallas_kernels.triton_prims import fp8_dot_nt  # noqa: E402


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def dot_check(values, tag):
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.choice(values, (64, 32)), jnp.float8_e4m3fn)
    b = jnp.asarray(rng.standard_normal((16, 32)) * 16, jnp.float8_e4m3fn)

    def kern(a_ref, b_ref, o_ref):
        o_ref[...] = fp8_dot_nt(a_ref[...], b_ref[...])

    got = pl.pallas_call(kern, out_shape=jax.ShapeDtypeStruct((64, 16), jnp.float32))(a, b)
    want = np.asarray(a, np.float64) @ np.asarray(b, np.float64).T
    print(f"fp8_dot_nt {tag}: rel err {rel(got, want):.3e}")


def chain_check():
    """Two fp8 dots chained through the accumulator (x's hi and lo planes) vs their exact sum."""
    rng = np.random.default_rng(1)
    a = jnp.asarray(rng.choice(mx.E2M1_VALUES, (64, 32)), jnp.float8_e4m3fn)
    x = jnp.asarray(rng.standard_normal((16, 32)), jnp.float32)
    hi, lo, inv = mx.split_e4m3_planes(x)

    def kern(a_ref, h_ref, l_ref, o_ref, o2_ref):
        o_ref[...] = fp8_dot_nt(a_ref[...], l_ref[...], fp8_dot_nt(a_ref[...], h_ref[...]))
        o2_ref[...] = fp8_dot_nt(a_ref[...], h_ref[...]) + fp8_dot_nt(a_ref[...], l_ref[...])

    sds = jax.ShapeDtypeStruct((64, 16), jnp.float32)
    chained, summed = pl.pallas_call(kern, out_shape=(sds, sds))(a, hi, lo)
    af = np.asarray(a, np.float64)
    want = af @ (np.asarray(hi, np.float64) + np.asarray(lo, np.float64)).T
    print(f"chained hi+lo dots: rel err {rel(chained, want):.3e}; summed in fp32 {rel(summed, want):.3e}; "
          f"hi only {rel(af @ np.asarray(hi, np.float64).T, want):.3e}")
    back = (np.asarray(hi, np.float64) + np.asarray(lo, np.float64)) * np.asarray(inv, np.float64)[:, None]
    print(f"split_e4m3_planes on {jax.devices()[0].platform}: reconstruction rel err {rel(back, x):.3e}, "
          f"lo nonzero {float(np.mean(np.asarray(lo, np.float64) != 0)):.2f}")


def _case(x_dtype):
    """x `[160, 1024]`, group sizes (decode-sized and larger groups, an empty one, uncovered tail rows) and MXFP4
    weights `[8, 512, 1024]`: the shapes of tests/test_moe_kernels.py's device test."""
    sizes = [8, 0, 70, 3, 8, 16, 1, 30]
    E, K, N, M = len(sizes), 1024, 512, 160
    x = jax.random.normal(jax.random.key(11), (M, K), x_dtype)
    return x, jnp.asarray(sizes, jnp.int32), mx.random_weight(jax.random.key(12), E, K, N)


def planes_check():
    """The kernel with only x's hi plane, only its lo plane (the other zeroed), against the exact products; and the
    split under jit on this device."""
    x, gs, w = _case(jnp.float32)
    wd = mx.dequantize(w, jnp.float32)
    hi, lo, inv = jax.jit(mx.split_e4m3_planes)(x)
    h2, l2, _ = mx.split_e4m3_planes(x)
    print(f"split under jit == eager: hi {bool(jnp.all(hi == h2))}, lo {bool(jnp.all(lo == l2))}")
    orig = gpu._fp8_x_planes
    cfg = gpu.GpuConfig(bm=16, bn=128, bk=256, swap_ab=True, dequant="fp8")
    for tag, keep in (("hi plane only", 0), ("lo plane only", 1)):
        def planes(xx, keep=keep):
            ps = orig(xx)
            ps[1 - keep] = jnp.zeros_like(ps[1 - keep])
            return ps
        gpu._fp8_x_planes = planes
        part = (hi, lo)[keep].astype(jnp.float32) * inv[:, None]
        want = reference.grouped_matmul(part, wd, gs)
        got = jax.jit(functools.partial(gpu.grouped_matmul, config=cfg))(x, (w,), gs)
        print(f"grouped_matmul fp8 {tag}: rel err {rel(got, want):.3e}")
    gpu._fp8_x_planes = orig


def main():
    print(jax.devices())
    chain_check()
    planes_check()
    normal = mx.E2M1_VALUES[mx.E2M1_VALUES != 0] * 2.0 ** 0
    dot_check(normal, "normal e4m3 (e2m1 values)")
    dot_check(mx.E2M1_VALUES * 2.0 ** -6, "e2m1 · 2^-6 (±0.5 -> subnormal 2^-7)")
    dot_check(np.array([2.0 ** -7, -(2.0 ** -7), 2.0 ** -9 * 3]), "subnormals only")
    x, gs, w = _case(jnp.bfloat16)
    p = np.asarray(w.packed)
    no_half = np.where((p & 7) == 1, p + 1, p)  # |v| = 0.5 -> 1 in the low nibble
    no_half = np.where(((no_half >> 4) & 7) == 1, no_half + 16, no_half).astype(np.uint8)
    for wtag, wq in (("random codes", w), ("no ±0.5 codes", mx.MXFP4Weight(jnp.asarray(no_half), w.scale))):
        want = reference.grouped_matmul(x, mx.dequantize(wq, jnp.bfloat16), gs)
        for form in ("asm_sign", "fp8"):
            cfg = gpu.GpuConfig(bm=16, bn=128, bk=256, swap_ab=form != "asm_sign", dequant=form)
            got = jax.jit(functools.partial(gpu.grouped_matmul, config=cfg))(x, (wq,), gs)
            print(f"grouped_matmul {form:9s} {wtag}: rel err {rel(got, want):.3e}")


if __name__ == "__main__":
    main()
