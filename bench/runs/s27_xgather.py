"""Session 27 probe (issue #6): what the MoE FFN's x gather costs in its possible forms, at K3 shapes.

The tile-layout FFN feeds its gate / up kernel x's planes (`mgpu_mxfp4._planes_in_contraction_order`) in some row
layout. Candidates, each one XLA program from the tokens `x_nd [N, 3584]` bf16 and the router's row -> token map:
  padded   — rows gathered into the R-row tile plan (t_max · R rows, dead tiles' zeros too), then planes (today);
  aligned8 — rows gathered into groups padded to 8 rows (the alignment a TMA copy's start needs), plus R zero rows;
  tokens   — as aligned8, but x's planes made on the N tokens first and the gather moving contiguous half-rows.
Device time per call from a chain of 20 calls in one program (`_timing.device_seconds`).

    python3 bench/runs/s27_xgather.py
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from _timing import device_seconds  # noqa: E402
from pallas_kernels.moe import mgpu_mxfp4 as mm  # noqa: E402

E, D, K_TOP = 112, 3584, 16
CHAIN = 20


def layouts(rows_per_expert: int, R: int, seed: int = 0):
    M = E * rows_per_expert
    N = M // K_TOP
    rng = np.random.default_rng(seed)
    sizes = jnp.asarray(rng.multinomial(M, [1 / E] * E), jnp.int32)
    token_of_row = jnp.asarray(rng.integers(0, N, M), jnp.int32)  # sorted rows' tokens (order irrelevant here)
    plan = mm.tile_plan(sizes, M, E, R)
    plan8 = mm.tile_plan(sizes, M, E, 8)
    src8 = jnp.concatenate([plan8.src, jnp.full((R,), M, jnp.int32)])
    return N, M, token_of_row, plan.src, src8


def tok_of(token_of_row, src, M):
    """The token of each laid-out row (N: none, a zero row)."""
    N_fill = jnp.iinfo(jnp.int32).max
    return jnp.where(src < M, token_of_row[jnp.minimum(src, M - 1)], N_fill)


def main():
    print("jax", jax.__version__, jax.devices()[0].device_kind)
    for rows_per_expert, R in ((8, 16), (32, 40), (64, 80), (146, 80)):
        N, M, token_of_row, src, src8 = layouts(rows_per_expert, R)
        xs = jax.random.normal(jax.random.key(1), (CHAIN, N, D), jnp.bfloat16)
        t_pad, t_8 = tok_of(token_of_row, src, M), tok_of(token_of_row, src8, M)

        def padded(x_nd):
            x_rows = x_nd[token_of_row]  # the dispatch gather (ops.expert_ffn)
            x_pad = x_rows.at[src].get(mode="fill", fill_value=0)
            return mm._planes_in_contraction_order(x_pad)

        def aligned8(x_nd):
            return mm._planes_in_contraction_order(x_nd.at[t_8].get(mode="fill", fill_value=0))

        def tokens(x_nd):
            planes = mm._planes_in_contraction_order(x_nd)  # [2, N, D/2]
            return planes.at[:, t_8].get(mode="fill", fill_value=0)

        def tokens_padded(x_nd):
            planes = mm._planes_in_contraction_order(x_nd)
            return planes.at[:, t_pad].get(mode="fill", fill_value=0)

        ref = np.asarray(aligned8(xs[0]))
        assert np.array_equal(np.asarray(tokens(xs[0])), ref)
        for name, f in (("padded", padded), ("aligned8", aligned8), ("tokens", tokens),
                        ("tokens_padded", tokens_padded)):
            out_rows = f(xs[0]).shape[1]
            us = device_seconds(f, xs, stacked=(0,))[0] * 1e6
            mb = out_rows * D * 2 / 1e6
            print(f"rows/expert {rows_per_expert:4d} R {R:3d}  {name:14s} out rows {out_rows:6d} ({mb:5.1f} MB)  "
                  f"{us:7.1f} µs/call (incl. the chain's read-back sum)")


if __name__ == "__main__":
    main()
