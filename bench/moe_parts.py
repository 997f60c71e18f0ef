#!/usr/bin/env python3
"""What bounds the MXFP4 expert FFN's two Mosaic GPU kernels (issue #6): each part of them taken out in turn.

    python3 bench/moe_parts.py [--rows 32] [--variants real,free,half,freehalf,stream,free_l2,stream_l2]

The FFN as the model runs it (`mgpu_mxfp4.expert_ffn_tiled`, K3 shapes at expert parallelism 8: 112 local experts,
3584 -> 3072 -> 3584, MXFP4, a balanced router's group sizes) is timed whole, then its two kernels alone — the fused
gate / up kernel and down, on the configs `tiled_config` gives — and again re-traced with a part of them replaced:

  real      the kernels as they are;
  free      the decode replaced by a constant A fragment (no shared loads of codes, no ALU work); the weight stream
            and every MMA stay: the stream + tensor-core time;
  half      the decode kept, its registers XOR-folded to 64 of the step's 128 columns so that all of it stays live,
            and only those columns' MMAs issued (half the tensor-core work);
  freehalf  no decode and half the MMAs;
  stream    no decode and no MMAs: the pipeline's copies and barriers alone (the kernels' own weight stream);
  *_l2      the same with every tile reading expert 0's weights (served from L2, not HBM): free_l2 is the MMAs at
            the kernels' tile shape (64 x rows x 16 wgmmas, A from registers) with no HBM stream and no decode.

The replacements patch the kernel module's private decode / step functions while a kernel is traced; only `real`
computes the FFN (its h feeds every variant's down kernel). Each line gives µs and the weight bytes per second as
a fraction of the copy bandwidth measured in the same run (torch, as bench/moe.py), the bar's unit (≥ 0.70 at
≤ 64 rows per expert). JSON goes to $OUT/moe_parts.json when OUT is set.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from _timing import torch_copy_bandwidth  # noqa: E402
from moe import situ, time_jax  # noqa: E402
from pallas_kernels.moe import mgpu_mxfp4 as mm  # noqa: E402
from pallas_kernels.moe.mgpu_mxfp4 import kernels as mk  # noqa: E402  (the module whose decode / step are patched)
from pallas_kernels.moe import mxfp4 as mx  # noqa: E402

E, D, F = 112, 3584, 3072


def _const_decode_fn(kh: int):
    """A decode that reads nothing: (lo, hi) `[64, kh]` bf16 WGMMA fragments of 1.0."""
    from jax._src.lib.mlir import ir
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mgu

    def fn(ctx, codes_ref, scales_ref):
        del ctx, codes_ref, scales_ref
        i32, bf16 = ir.IntegerType.get_signless(32), ir.BF16Type.get()
        layout = fa.WGMMA_LAYOUT
        reg_shape = layout.registers_shape((mm.COLS, kh))
        one = mgu.bitcast(mgu.c(0x3F803F80, i32), ir.VectorType.get((2,), bf16))
        regs = np.empty(reg_shape, dtype=object)
        for i in np.ndindex(reg_shape):
            regs[i] = one
        arr = fa.FragmentedArray(_registers=regs, _layout=layout, _is_signed=None)
        return arr, arr

    return fn, kh


def _folded_decode_fn(kh: int, code_layout: str):
    """The real decode, its `[64, kh]` fragments XOR-folded to `[64, BLOCK]` (column block c collects every block
    ≡ c mod BLOCK/8), so every decoded register stays live while the MMAs cover BLOCK of the step's kh columns."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mgu

    real = mm._decode_fn(kh, code_layout)
    keep = mm.BLOCK // 8

    def fold(arr):
        i32, bf16 = ir.IntegerType.get_signless(32), ir.BF16Type.get()
        v2 = ir.VectorType.get((2,), bf16)
        regs = arr.registers
        out_shape = list(regs.shape)
        out_shape[1] = keep
        out = np.empty(out_shape, dtype=object)
        for idx in np.ndindex(*out_shape):
            acc = None
            for c in range(idx[1], regs.shape[1], keep):
                src = list(idx)
                src[1] = c
                w = mgu.bitcast(regs[tuple(src)], i32)
                acc = w if acc is None else arith.xori(acc, w)
            out[idx] = mgu.bitcast(acc, v2)
        return fa.FragmentedArray(_registers=out, _layout=arr.layout, _is_signed=None)

    def fn(ctx, codes_ref, scales_ref):
        lo, hi = real(ctx, codes_ref, scales_ref)
        return fold(lo), fold(hi)

    return fn, mm.BLOCK


def _inline(fn_cols):
    import jax.experimental.pallas.mosaic_gpu as plgpu

    fn, cols = fn_cols
    t = plgpu.ShapeDtypeStruct((mm.COLS, cols), jnp.bfloat16, layout=plgpu.Layout.WGMMA)
    return plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()), return_type=(t, t))(fn)


def _half_decode_and_mma(decode, acc_refs, w_bufs, xs_s):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    for i, acc_ref in enumerate(acc_refs):
        lo, hi = decode(w_bufs[2 * i], w_bufs[2 * i + 1])
        cols = pl.ds(0, mm.BLOCK)
        plgpu.wgmma(acc_ref, lo, plgpu.transpose_ref(xs_s.at[0, :, cols], (1, 0)))
        plgpu.wgmma(acc_ref, hi, plgpu.transpose_ref(xs_s.at[1, :, cols], (1, 0)))
        plgpu.wgmma_wait(0)


@contextlib.contextmanager
def variant(name: str):
    """Patch the kernel's decode (and, for "half", its step) while a kernel is traced and compiled."""
    saved = mk._bf16_decode, mk._decode_and_mma
    name = name.removesuffix("_l2")
    if name == "free":
        mk._bf16_decode = lambda kh, layout: _inline(_const_decode_fn(kh))
    elif name == "half":
        mk._bf16_decode = lambda kh, layout: _inline(_folded_decode_fn(kh, layout))
        mk._decode_and_mma = _half_decode_and_mma
    elif name == "freehalf":
        mk._bf16_decode = lambda kh, layout: _inline(_const_decode_fn(mm.BLOCK))
        mk._decode_and_mma = _half_decode_and_mma
    elif name == "stream":
        mk._decode_and_mma = lambda *_: None
    try:
        yield
    finally:
        mk._bf16_decode, mk._decode_and_mma = saved


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=32, help="mean rows per expert (default 32)")
    ap.add_argument("--variants", default="real,free,half,freehalf,stream,free_l2,stream_l2",
                    help="comma-separated, from the list above (default all)")
    args = ap.parse_args()
    copy_bw = torch_copy_bandwidth()
    keys = jax.random.split(jax.random.key(11), 4)
    ws = [mx.random_weight(keys[0], E, D, F), mx.random_weight(keys[1], E, D, F), mx.random_weight(keys[2], E, F, D)]
    wg, wu, wd = mm.prepare_ffn_weights(*ws)  # as a model prepares them (gate / up columns in down's plane order)
    m = E * args.rows
    x = jax.random.normal(keys[3], (m, D), jnp.bfloat16)
    sizes = jnp.asarray(np.random.default_rng(200 + args.rows).multinomial(m, [1 / E] * E), jnp.int32)
    cfg = mm.tiled_config(args.rows, (F, D))
    gcfg = mm.fit_config(cfg, D)
    down_cfg = mm.fit_config(cfg.down_config or cfg, F)
    plan = jax.jit(lambda g: mm.tile_plan(g, m, E, cfg.rows))(sizes)
    xs = jax.jit(lambda a, p: mm._tile_layout_operands(mm.gather_x(a, p.src), wg, cfg)[0])(x, plan)
    live_tiles = int(plan.num_tiles[0])
    gate_up_bytes, down_bytes = sum(q.nbytes for q in ws[:2]), ws[2].nbytes
    ffn_bytes = gate_up_bytes + down_bytes
    print(f"copy {copy_bw / 1e12:.2f} TB/s; {args.rows} rows/expert (max group {int(sizes.max())}): {live_tiles} "
          f"live tiles of {cfg.rows}; gate/up {gcfg}; down {down_cfg}", flush=True)
    ffn = jax.jit(lambda a, g, *w: mm.expert_ffn_tiled(a, g, *w, situ, config=cfg))
    t_ffn = time_jax(ffn, x, sizes, wg, wu, wd, reps=20)
    print(f"the whole FFN: {t_ffn * 1e6:.0f} us = {ffn_bytes / t_ffn / copy_bw:.3f} of copy", flush=True)
    result = dict(rows=args.rows, copy_tb_s=copy_bw / 1e12, ffn_us=t_ffn * 1e6, live_tiles=live_tiles, parts={})
    plan_l2 = plan._replace(tile_group=jnp.zeros_like(plan.tile_group))
    h = None
    for name in args.variants.split(","):
        p_ = plan_l2 if name.endswith("_l2") else plan
        with variant(name):
            gu = jax.jit(lambda a, p, w1, w2: mm.kernel_call_gated_ws(
                a, p.tile_group, p.num_tiles, w1, w2, situ, gcfg, mm.expert_scale(w1), mm.expert_scale(w2),
                jnp.bfloat16))
            h_v = jax.block_until_ready(gu(xs, p_, wg, wu))
            t_gu = time_jax(gu, xs, p_, wg, wu, reps=20)
            if h is None:
                h = h_v  # the first variant's h (real's, when it runs first) feeds every down kernel
            dn = jax.jit(lambda a, p, w_: mm.kernel_call(a, p.tile_group, p.num_tiles, w_, down_cfg))
            t_d = time_jax(dn, h, p_, wd, reps=20)
        both = t_gu + t_d
        result["parts"][name] = dict(gate_up_us=t_gu * 1e6, down_us=t_d * 1e6)
        print(f"{name:9s} gate/up {t_gu * 1e6:4.0f} us ({gate_up_bytes / t_gu / copy_bw:.2f} of copy) + down "
              f"{t_d * 1e6:4.0f} us ({down_bytes / t_d / copy_bw:.2f}) = {both * 1e6:4.0f} us: "
              f"{ffn_bytes / both / copy_bw:.3f} of copy for the kernels alone", flush=True)
    if "real" in result["parts"]:
        real = result["parts"]["real"]
        glue = t_ffn * 1e6 - real["gate_up_us"] - real["down_us"]
        print(f"the FFN's XLA around the kernels (FFN - real kernels): {glue:.0f} us", flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "moe_parts.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
