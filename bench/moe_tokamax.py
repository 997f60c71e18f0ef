"""Peer: tokamax's `ragged_dot` (Mosaic GPU on Hopper) beside our grouped matmul at K3 shapes, bf16 and 4-bit.

    python3 bench/moe_tokamax.py [--skip bf16|mxfp4]

Issue #6 names tokamax `ragged_dot` as a library to measure side by side and depend on if it wins. Two sections,
both on the inputs `bench/moe.py` draws (same seeds, so the same group sizes):
- bf16: E = 112, 16384 rows, 3584 -> 3072, random group sizes; tokamax (its default implementation order and
  heuristic config, then `implementation="triton"`) vs ours (`ops.grouped_matmul`, GPU backend) vs a dense XLA matmul of
  the same FLOPs, in TFLOP/s.
- 4-bit weights at 8 rows per expert (the MXFP4 bar's decode size): tokamax takes a qwix `QArray`; the K3
  checkpoint's MXFP4 is e2m1 codes with one power-of-two scale per 32 inputs, given to it as `float4_e2m1fn` values
  with bf16 scales `[E, K/32, N]` (its heuristic then picks 32-wide K blocks). If its kernel refuses e2m1 the same
  bytes go in as int4 codes (a speed peer only; its own reference checks it). Ours: the Mosaic kernel on prepared
  weights (`mgpu_mxfp4.grouped_matmul`). Weight bytes/s vs copy bandwidth.
Every timed call is checked against a float32 reference first. Needs tokamax 0.0.17 (Python >= 3.12, jax >= 0.11.1)
and its small dependencies; the GPU image has neither — carry the wheels into `.whl/` (`source bench/device_env.sh`). It imports
`xprof` only for its own benchmarking helpers: a stand-in module is put in its place when xprof is missing.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe as mb  # noqa: E402  (bench/moe.py: shapes, timing, reference helpers)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels.moe import mgpu_mxfp4 as mgpu_mx  # noqa: E402
from pallas_kernels.moe import mxfp4 as mx  # noqa: E402
from pallas_kernels.moe import ops  # noqa: E402

E, M, K, N = mb.E, mb.M, mb.K, mb.N


def import_tokamax():
    try:
        from xprof.cli.tools import get_kernel_stats_tool  # noqa: F401
    except ImportError:  # only tokamax's own benchmarking helpers use it: stand-in package xprof.cli.tools
        for name in ("xprof", "xprof.cli", "xprof.cli.tools"):
            module = types.ModuleType(name)
            module.__path__ = []  # a package, so the submodule import resolves
            sys.modules[name] = module
        sys.modules["xprof.cli.tools"].get_kernel_stats_tool = None
        sys.modules["xprof"].cli = sys.modules["xprof.cli"]
        sys.modules["xprof.cli"].tools = sys.modules["xprof.cli.tools"]
    import tokamax

    return tokamax


def timed(label, f, args, ref, flops=None, nbytes=None, copy_bw=None):
    try:
        err = mb.rel_err(f(*args), ref)
        if err > 2e-2:
            raise AssertionError(f"wrong result, rel err {err:.3g}")
        t = mb.time_jax(f, *args)
    except Exception as e:  # noqa: BLE001 — a peer that refuses the shape is a result too
        print(f"{label}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:600] if str(e) else ''}", flush=True)
        traceback.print_exc(limit=2)
        return None
    rate = f"{flops / t / 1e12:.0f} TFLOP/s" if flops else f"{nbytes / t / 1e12:.2f} TB/s = {nbytes / t / copy_bw:.3f} of copy"
    print(f"{label}: {t * 1e6:.0f} us, {rate}, err {err:.2e}", flush=True)
    return t


def bench_bf16(tk):
    kx, kw, ks, _ = jax.random.split(jax.random.key(0), 4)  # as bench/moe.py's bf16 section
    x = jax.random.normal(kx, (M, K), jnp.bfloat16)
    w = (jax.random.normal(kw, (E, K, N), jnp.float32) * K ** -0.5).astype(jnp.bfloat16)
    sizes = mb.random_sizes(ks, M, E)
    flops = 2.0 * M * K * N
    ref = jax.jit(lambda a, b, g: jax.lax.ragged_dot(a, b, g, preferred_element_type=jnp.float32))(x, w, sizes)
    t_dense = mb.time_jax(jax.jit(lambda a, b: jnp.dot(a, b)), x, w[0])
    print(f"dense XLA (one weight, same FLOPs): {t_dense * 1e6:.0f} us, {flops / t_dense / 1e12:.0f} TFLOP/s", flush=True)
    timed("ours (ops.grouped_matmul, gpu)", jax.jit(
        lambda a, b, g: ops.grouped_matmul(a, b, g, backend="gpu", out_dtype=jnp.bfloat16)), (x, w, sizes), ref, flops)
    timed("tokamax.ragged_dot (default implementation)", jax.jit(
        lambda a, b, g: tk.ragged_dot(a, b, g, preferred_element_type=jnp.bfloat16)), (x, w, sizes), ref, flops)
    timed("tokamax.ragged_dot (triton; needs a jax-triton that matches the image's triton)", jax.jit(
        lambda a, b, g: tk.ragged_dot(a, b, g, preferred_element_type=jnp.bfloat16, implementation="triton")),
        (x, w, sizes), ref, flops)


def bench_4bit(tk, copy_bw, rows_per_expert: int = 8):
    import qwix

    m = E * rows_per_expert
    w = mx.random_weight(jax.random.key(1), E, K, N)  # MXFP4Weight: codes [E, N, K/2], E8M0 scales [E, N, K/32]
    x = jax.random.normal(jax.random.key(100 + rows_per_expert), (m, K), jnp.bfloat16)
    sizes = mb.ffn_sizes("routed", 200 + rows_per_expert, m)
    # the weight as an argument: closed over, jit would embed it in the program as a constant
    ref = jax.jit(lambda a, g, w: ops.grouped_matmul(a, w, g, backend="reference"))(x, sizes, w)
    nbytes = w.nbytes
    wp = mgpu_mx.prepare_weight(w)
    timed(f"ours (Mosaic MXFP4, {rows_per_expert} rows/expert)",
          jax.jit(lambda a, g, p: mgpu_mx.grouped_matmul(a, p, g)), (x, sizes, wp), ref, nbytes=nbytes, copy_bw=copy_bw)
    # the same weights as qwix sees them: e2m1 values [E, K, N] and their scales 2^(s - 127) [E, K/32, N]
    unit = mx.MXFP4Weight(w.packed, jnp.full_like(w.scale, 127))
    values_ekn = mx.dequantize(unit, jnp.float32)
    scale_ekn = jnp.swapaxes(jnp.exp2(w.scale.astype(jnp.float32) - 127.0), 1, 2).astype(jnp.bfloat16)
    q_e2m1 = qwix.QArray(values_ekn.astype(jnp.float4_e2m1fn), scale_ekn, qtype=jnp.float4_e2m1fn)
    # implementation="mosaic": its Mosaic GPU kernel or an error that says why (the default order falls back to
    # Triton, which does not run against the image's triton 3.6)
    # bf16 out: its sm90 quantised kernel needs the 128-byte output swizzle to span its 64-wide N block
    f = jax.jit(lambda a, g, q: tk.ragged_dot(a, q, g, preferred_element_type=jnp.bfloat16, implementation="mosaic"))
    timed(f"tokamax.ragged_dot (e2m1 QArray, 32-input bf16 scales, {rows_per_expert} rows/expert)",
          f, (x, sizes, q_e2m1), ref, nbytes=nbytes, copy_bw=copy_bw)
    # the same number of 4-bit codes as int4 (a speed peer, checked against its own reference), with scales per 32
    # inputs as MXFP4 has them, then per 128 (its heuristic's K block; fewer scale bytes than MXFP4 reads)
    codes = jax.random.randint(jax.random.key(2), (E, K, N), -8, 8).astype(jnp.int4)
    for group in (32, 128):
        scale = scale_ekn if group == 32 else scale_ekn[:, ::4]
        q_i4 = qwix.QArray(codes, scale, qtype=jnp.int4)
        w_i4 = codes.astype(jnp.float32) * jnp.repeat(scale.astype(jnp.float32), group, axis=1)
        ref_i4 = jax.jit(lambda a, b, g: jax.lax.ragged_dot(a.astype(jnp.float32), b, g))(x, w_i4, sizes)
        timed(f"tokamax.ragged_dot (int4 QArray, {group}-input bf16 scales, {rows_per_expert} rows/expert)", f,
              (x, sizes, q_i4), ref_i4, nbytes=nbytes, copy_bw=copy_bw)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip", default="", help="comma-separated sections to skip: bf16, mxfp4")
    args = ap.parse_args()
    t0 = time.time()
    tk = import_tokamax()
    print(f"jax {jax.__version__}, tokamax {tk.__version__}, {jax.devices()[0].device_kind}", flush=True)
    copy_bw = mb.copy_bandwidth()
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s", flush=True)
    skip = set(filter(None, args.skip.split(",")))
    if "mxfp4" not in skip:
        bench_4bit(tk, copy_bw)
    if "bf16" not in skip:
        bench_bf16(tk)
    print(f"done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
