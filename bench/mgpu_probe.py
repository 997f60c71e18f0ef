"""Probe: how fast does a Mosaic GPU kernel with register-side weight conversion stream weights at decode shapes?

    python3 bench/mgpu_probe.py [--rows 16,32] [--budget 120]      (an H100/H200; jax with Mosaic GPU)

Why: the MXFP4 grouped matmul in Triton (`pallas_kernels.moe.gpu_triton`; measured when it was a Pallas Triton kernel)
is issue-bound at 0.46 of copy bandwidth (bar 0.70). A CPU screen of its SASS (ptxas on the pip triton) put every Triton
tile shape at 0.14–0.15 warp instructions per weight element, of which the e2m1 decode is about half: the rest are
Triton's operand shuffles, register moves and address arithmetic. A hand-scheduled Hopper kernel (TMA loads, weights
converted in registers straight into the wgmma A operand, warp-specialised pipeline) is the known way around that, and
JAX ships one: `jax.experimental.pallas.ops.gpu.hopper_mixed_type_matmul_mgpu` (int8 × bf16). Mosaic GPU's fp4
conversions are Blackwell-only, so an MXFP4 version would need its own decode; this probe first measures the machinery
with int8 weights at our decode shape — all 112 experts' 3072 × 3584 weights stacked as one LHS (the same bytes a decode
step streams), x as a 16- or 32-column RHS — as weight bytes/s vs the copy bandwidth measured in the same run. It is a
ceiling indicator, not a result for the bar: int8 carries one element per byte, MXFP4 two.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from _timing import pipelined_seconds, torch_copy_bandwidth

E, K, N = 112, 3584, 3072


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="16,32", help="x rows (the RHS's columns) to try")
    ap.add_argument("--budget", type=float, default=120.0, help="seconds for the whole probe")
    args = ap.parse_args()
    t0 = time.time()
    from jax.experimental.pallas.ops.gpu import hopper_mixed_type_matmul_mgpu as hm

    bw = torch_copy_bandwidth()  # the denominator the other benches use
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s (torch device copy, bytes read + written)")
    m = E * N
    a = jax.random.randint(jax.random.key(0), (m, K), -127, 128, jnp.int8)  # 1.23 GB: the stacked expert weights
    results = []
    for rows in [int(r) for r in args.rows.split(",")]:
        b = jax.random.normal(jax.random.key(1), (K, rows), jnp.bfloat16)
        ref = None
        for tile_k, steps, tile_m in [(256, 4, 64), (256, 5, 64), (128, 8, 64), (128, 4, 128), (256, 3, 128),
                                      (512, 2, 64)]:
            if time.time() - t0 > args.budget:
                print("budget spent")
                break
            cfg = hm.TuningConfig(tile_m=tile_m, tile_n=rows, tile_k=tile_k, max_concurrent_steps=steps,
                                  epi_tile_n=rows, epi_tile_m=64, wg_dimension=hm.MatmulDimension.M)
            name = f"rows={rows} tile_m={tile_m} tile_k={tile_k} steps={steps}"
            try:
                f = jax.jit(lambda a, b, cfg=cfg: hm.mixed_matmul_kernel(a, b, out_dtype=jnp.bfloat16, config=cfg))
                out = jax.block_until_ready(f(a, b))
                if ref is None:  # the first 64K rows against XLA in fp32
                    ref = np.asarray(jnp.dot(a[:65536].astype(jnp.float32), b.astype(jnp.float32)))
                got = np.asarray(out[:65536].astype(jnp.float32))
                err = float(np.sqrt(np.mean((got - ref) ** 2) / np.mean(ref ** 2)))
                t = pipelined_seconds(f, a, b, reps=20)
                tbps = a.size / t / 1e12
                print(f"{name}: {t * 1e6:.1f} us, weights {tbps:.2f} TB/s = {tbps * 1e12 / bw:.3f} of copy, "
                      f"rel err {err:.1e}")
                results.append(dict(rows=rows, tile_m=tile_m, tile_k=tile_k, steps=steps, us=t * 1e6, TBps=tbps,
                                    frac=tbps * 1e12 / bw, err=err))
            except Exception as e:  # a config the kernel rejects (shared memory, divisibility): note and go on
                print(f"{name}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "mgpu_probe.json"), "w") as fh:
            json.dump(dict(copy_TBps=bw / 1e12, jax=jax.__version__, results=results), fh, indent=1)


if __name__ == "__main__":
    main()
