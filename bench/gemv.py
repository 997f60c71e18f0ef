#!/usr/bin/env python3
"""Decode-size projections (a few rows times a weight matrix) against the copy rate, in the forms XLA can take.

    source bench/device_env.sh && python3 bench/gemv.py      # one GPU, < 2 minutes
    python3 bench/gemv.py --smoke                             # CPU: tiny shapes, runs the code, no figures

At one decode row XLA's GPU compiler rewrites a vector × matrix dot whose matrix has < 10M elements into a multiply
and a reduction over the contraction ("dot strength reduction"); with the weight stored `[in, out]` (`Linear`'s
layout) that is a column reduction. A device trace of Kimi-Linear-48B decoding one stream on an H100 put its
2304 × 4096 projections in such reductions at 0.3-0.45 of the copy rate. Per shape and row count, each form times
a chain of distinct weights (more bytes than L2 holds) and reports weight bytes/s over the copy bandwidth:

  xla      `jnp.dot(x [M, K], w [K, N])`, float32 accumulation: the plain dot
  xla_m2   what `Linear` runs (`kimi_jax.modules.layers.matmul`): on a GPU one row padded to two (not a vector: the
           dot stays a matmul) and the row sliced back; more rows the plain dot
  xla_nk   the weight stored `[N, K]`, `x @ w.T` (at one row: a reduction along contiguous rows)
  torch    `torch.nn.functional.linear` on the `[N, K]` weight (cuBLAS), CUDA events

Writes the table and $OUT/gemv.json. Run it under other XLA_FLAGS (`--label` keeps each run's file) to see what XLA's
GPU options change, e.g. `--xla_gpu_enable_triton_gemm=false` (cuBLAS for every dot). The strength reduction has
no flag (jaxlib 0.11: its DebugOptions field is gone), hence `xla_m2`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ap = argparse.ArgumentParser()
ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, no figures")
ap.add_argument("--rows", default="1,2,8,32", help="comma-separated decode rows M")
ap.add_argument("--forms", default="xla,xla_m2,xla_nk,torch", help="comma-separated forms to time (below)")
ap.add_argument("--label", default="", help="suffix of $OUT/gemv<_label>.json: runs under other XLA_FLAGS side by side")
ARGS = ap.parse_args()
FORMS = ARGS.forms.split(",")
if ARGS.smoke:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from _timing import device_seconds, torch_copy_bandwidth  # noqa: E402

from kimi_jax.modules.layers import matmul  # noqa: E402

# (name, K, N): Kimi-Linear-48B's KDA q / k / v and o projections, its shared expert's gate; K3.1's q_a (> 10M)
SHAPES = [("48b kda q", 2304, 4096), ("48b kda o", 4096, 2304), ("48b shared gate", 2304, 1024),
          ("k3.1 q_a", 7168, 1536)]
if ARGS.smoke:
    SHAPES = [("tiny", 64, 96)]
COPIES = 2 if ARGS.smoke else 8  # distinct weights per timing chain: 8 × 18.9 MB > the 50 MB L2


def forms():
    def xla(x, w_kn, w_nk):
        return jnp.dot(x, w_kn, preferred_element_type=jnp.float32).astype(x.dtype)

    def xla_m2(x, w_kn, w_nk):
        return matmul(x, w_kn).astype(x.dtype)

    def xla_nk(x, w_kn, w_nk):
        return jnp.einsum("mk,nk->mn", x, w_nk, preferred_element_type=jnp.float32).astype(x.dtype)

    return {"xla": xla, "xla_m2": xla_m2, "xla_nk": xla_nk}


def torch_seconds(x, w_nk_stack):
    """cuBLAS through torch on the same bytes (None without CUDA torch)."""
    try:
        import torch
        if not torch.cuda.is_available():
            return None
    except ImportError:
        return None
    from _timing import torch_event_seconds

    tx = torch.from_dlpack(x)
    tw = [torch.from_dlpack(w_nk_stack[i]) for i in range(w_nk_stack.shape[0])]
    per_chain = torch_event_seconds(lambda i: [torch.nn.functional.linear(tx, w) for w in tw])
    return per_chain / len(tw)


def main():
    bw = 1e9 if ARGS.smoke else torch_copy_bandwidth(1 << 31)
    rows_out = []
    key = jax.random.PRNGKey(0)
    for name, K, N in SHAPES:
        w_kn = (jax.random.normal(key, (COPIES, K, N), jnp.float32) * K ** -0.5).astype(jnp.bfloat16)
        w_nk = jnp.swapaxes(w_kn, 1, 2).copy()
        nbytes = K * N * 2
        for M in (int(m) for m in ARGS.rows.split(",")):
            x = jax.random.normal(jax.random.fold_in(key, M), (M, K), jnp.bfloat16)
            want = jnp.dot(x.astype(jnp.float32), w_kn[0].astype(jnp.float32))
            times = {}
            for fname, f in ((k, v) for k, v in forms().items() if k in FORMS):
                got = jax.jit(f)(x, w_kn[0], w_nk[0]).astype(jnp.float32)
                err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
                assert err < 2e-2, (name, M, fname, err)
                times[fname] = device_seconds(f, x, w_kn, w_nk, stacked=(1, 2))[0]
            t_torch = None if ARGS.smoke or "torch" not in FORMS else torch_seconds(x, w_nk)
            if t_torch:
                times["torch"] = t_torch
            row = {"shape": name, "K": K, "N": N, "M": M, "copy_TBps": bw / 1e12,
                   **{f"us_{k}": v * 1e6 for k, v in times.items()},
                   **{f"of_copy_{k}": nbytes / v / bw for k, v in times.items()}}
            rows_out.append(row)
            print(f"{name:16s} {K}x{N} M={M:3d}: " + ", ".join(
                f"{k} {v * 1e6:7.1f} us ({nbytes / v / bw:.2f} of copy)" for k, v in times.items()), flush=True)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; jax {jax.__version__}, {jax.devices()[0]}; "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    out = os.environ.get("OUT")
    if out:
        name = f"gemv_{ARGS.label}.json" if ARGS.label else "gemv.json"
        with open(os.path.join(out, name), "w") as fh:
            json.dump(dict(rows=rows_out, jax=jax.__version__, device=str(jax.devices()[0]),
                           xla_flags=os.environ.get("XLA_FLAGS", "")), fh, indent=1)


if __name__ == "__main__":
    main()
