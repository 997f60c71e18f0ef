"""One MXFP4 expert FFN call (`mgpu_mxfp4.expert_ffn_tiled`) on a GPU, for Nsight Compute (issue #6).

K3 shapes at expert parallelism 8: 112 local experts, 3584 -> 3072 -> 3584, a balanced router's group sizes (about
R ± sqrt(R) rows per expert). Compiles and runs the FFN once, then runs it once more between cudaProfilerStart /
Stop, so ncu sees only that call's kernels (the fused gate / up kernel, down, and XLA's gathers):

    ncu --profile-from-start off --clock-control none --section SpeedOfLight --section WarpStateStats \\
        python3 bench/moe_profile.py --rows 32 [--config '{"rows": 48}']

`--config`: overrides of `mgpu_mxfp4.tiled_config(rows)`. `--tokens`: the model's whole path instead
(`ops.expert_ffn`: rows / 16 · 112 tokens routed top-16 — the plan from the pairs, the FFN gathering from the
tokens, the weighted combine back into the tokens); `--tokens --sorted-plan`: the same with the sorted
plan (`ops.dispatch_plan`) for comparison.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dsa_profile import _cudart  # noqa: E402
from moe import situ  # noqa: E402  (docs/model.md §7's K3 activation, as the MoE bench uses it)
from pallas_kernels.moe import mgpu_mxfp4 as mm  # noqa: E402
from pallas_kernels.moe import mxfp4 as mx  # noqa: E402

E, D, F = 112, 3584, 3072  # local experts at EP 8, K3's hidden and expert widths
TOP_K = 16


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=32, help="mean rows per expert (default 32)")
    ap.add_argument("--config", default="{}", help="JSON overrides of tiled_config(rows)")
    ap.add_argument("--tokens", action="store_true",
                    help="profile ops.expert_ffn (tokens -> sort -> FFN -> combine), as the model runs it")
    ap.add_argument("--sorted-plan", action="store_true",
                    help="with --tokens: the sorted-plan path (ops.dispatch_plan, the FFN on the sorted plan handing "
                         "its rows back in slot order) instead of ops.expert_ffn's plan from the pairs")
    args = ap.parse_args()
    keys = jax.random.split(jax.random.key(11), 4)
    ws = [mx.random_weight(keys[0], E, D, F), mx.random_weight(keys[1], E, D, F), mx.random_weight(keys[2], E, F, D)]
    wp = mm.prepare_ffn_weights(*ws)  # as a model prepares them: gate / up columns in down's x-plane order
    m = E * args.rows
    x = jax.random.normal(keys[3], (m, D), jnp.bfloat16)
    sizes = jnp.asarray(np.random.default_rng(200 + args.rows).multinomial(m, [1 / E] * E), jnp.int32)
    cfg = dataclasses.replace(mm.tiled_config(args.rows, (F, D)), **json.loads(args.config))
    ffn = jax.jit(lambda a, g, *w: mm.expert_ffn_tiled(a, g, *w, situ, config=cfg))
    inputs = (x, sizes)
    if args.tokens:  # the model's path: each of m / 16 tokens sent to 16 distinct experts, random weights
        from pallas_kernels.moe import ops

        n_tok = m // TOP_K
        rng = np.random.default_rng(300 + args.rows)
        idx = np.stack([rng.choice(E, TOP_K, replace=False) for _ in range(n_tok)])
        sizes = np.bincount(idx.ravel(), minlength=E)
        weights = jnp.asarray(rng.random((n_tok, TOP_K)), jnp.float32)
        ffn = jax.jit(lambda a, i, *w: ops.expert_ffn(a, i, weights, *w, situ, configs=(cfg, None)))
        if args.sorted_plan:
            def sorted_plan(a, i, *w):
                _, t, g, slot_row = ops.dispatch_plan(i, E)
                y = mm.expert_ffn_tiled(a, g, *w, situ, config=cfg, token_of_row=t, out_rows=slot_row)
                return ops.combine_slots(y, weights)
            ffn = jax.jit(sorted_plan)
        inputs = (x[:n_tok], jnp.asarray(idx, jnp.int32))
    jax.block_until_ready(ffn(*inputs, *wp))
    print(f"compiled: {args.rows} rows/expert, max group {int(sizes.max())}, {cfg}"
          + (f", from {m // TOP_K} tokens (ops.expert_ffn)" if args.tokens else ""), flush=True)
    cudart = _cudart()
    cudart.cudaProfilerStart()
    jax.block_until_ready(ffn(*inputs, *wp))
    cudart.cudaProfilerStop()
    print("profiled call done", flush=True)


if __name__ == "__main__":
    main()
