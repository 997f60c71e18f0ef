"""`grouped_matmul`: the Mosaic GPU MXFP4 grouped matmul on rows sorted by expert, the entry point `moe.ops` calls.

x `[M, K]`, a `PreparedWeight` `[E, N, K/2]`, group_sizes `[E]` -> `[M, N]` (rows past Σ group_sizes are zeros).
Two group plans (`MgpuConfig.plan`): "xla" pads rows per expert in XLA (`rows.prepare_rows`) and gathers the
result back; "kernel" (`kernel_call_grouped`) reads each expert's row bounds in the kernel and stores its rows in
place, so nothing is padded. `mma="fp8"` runs the experimental fp8 path (pallas_kernels/experimental).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from .config import BLOCK, COLS, MgpuConfig, ROW_ALIGN
from .decode import _bf16_decode
from .kernels import _cta_grid, _mma_over_k, kernel_call
from .layout import PreparedWeight, _planes_in_contraction_order, config_for, expert_scale, planes_column_order
import pallas_kernels.experimental.mxfp4_fp8_mma as fp8_mma
from .rows import group_bounds, prepare_rows, unpad_output


def _store_direct_fn():
    """The inline Mosaic GPU body that stores a WGMMA-layout `[64, RX]` fp32 tile straight from registers: element
    (c, r) -> out[base + r, col0 + c] where lo ≤ r < hi, else nothing (a predicated 4-byte global store; a warp's
    store covers 4 rows × 32 contiguous bytes). base, lo, hi and col0 come as int32 splats in the same layout (each
    thread reads its own register: no shared scratch to race on between work items)."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, memref, scf, vector
    from jax.experimental.mosaic.gpu import utils as mgu

    def fn(ctx, acc, base_a, lo_a, hi_a, col0_a, out_ref):
        del ctx
        index, i32 = ir.IndexType.get(), ir.IntegerType.get_signless(32)
        first = tuple(0 for _ in base_a.registers.shape)

        def scalar(a):
            reg = a.registers[first]
            if isinstance(reg.type, ir.VectorType):
                reg = vector.extract(reg, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([0]))
            return reg

        base, lo, hi, col0 = (scalar(a) for a in (base_a, lo_a, hi_a, col0_a))
        base_i, col0_i = arith.index_cast(index, base), arith.index_cast(index, col0)
        regs = acc.registers
        for (c, r), ri in zip(acc.layout.thread_idxs(acc.shape), np.ndindex(regs.shape)):
            reg = regs[ri]  # vector<2xf32>: N-side positions r, r + 1 of M-side position c
            out_c = arith.addi(col0_i, c)
            for k in range(ir.VectorType(reg.type).shape[0]):
                rk = arith.addi(r, mgu.c(k, index))
                rk32 = arith.index_cast(i32, rk)
                ok = arith.andi(arith.cmpi(arith.CmpIPredicate.sge, rk32, lo),
                                arith.cmpi(arith.CmpIPredicate.slt, rk32, hi))
                v = vector.extract(reg, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([k]))
                if_op = scf.IfOp(ok)
                with ir.InsertionPoint(if_op.then_block):
                    memref.store(v, out_ref, [arith.addi(base_i, rk), out_c])
                    scf.yield_([])

    return fn


def prepare_grouped(x, group_sizes, config: MgpuConfig):
    """XLA side of plan "kernel": `x [M, K]` -> (x planes in the contraction order `[2, max(M, R + 8), K/2]` bf16,
    `group_bounds` `[E + 2]`)."""
    M, R = x.shape[0], config.rows
    x = x.astype(jnp.bfloat16)
    if M < R + ROW_ALIGN:  # one x tile (R + 8 rows) fits the array
        x = jnp.pad(x, ((0, R + ROW_ALIGN - M), (0, 0)))
    return _planes_in_contraction_order(x), group_bounds(group_sizes, M)


def kernel_call_grouped(xs, bounds, w: PreparedWeight, config: MgpuConfig, row_scale=None, *, out_rows=None):
    """The kernel with its group plan inside (`MgpuConfig.plan="kernel"`): x planes `[2, M, K/2]` bf16 in the
    contraction order (`prepare_grouped`, rows as sorted), `group_bounds` `[E + 2]`, the weight, and for the placed
    layout each expert's fp32 output factor `row_scale [E]` (`out_scale`) -> out `[out_rows, N]` fp32 (default M).

    Work item (expert e, 64-column block nb), looping over e's rows: each tile fetches R + 8 x rows from its first
    row rounded down to a multiple of 8 (TMA into the 8-row-tiled smem operand needs that; the MMA's N side is
    R + 8) and takes as many of the group's rows as they hold (R + 1 … R + 8, so fewer passes over the expert's
    weights than R-row tiles); rows of other groups or past M ride along (TMA reads zeros past M) and are never
    stored. Each thread then stores its own elements of the tile's rows in place (`_store_direct_fn`). Item (E, nb)
    zeroes the rows past Σ sizes. No padding and no gathers outside the kernel; the items are as uneven as the
    groups."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    _, M, KH = xs.shape
    cfg = config
    R, kh = cfg.rows, cfg.kh
    E, N, KH2 = w.codes.shape
    RX = R + ROW_ALIGN  # x rows per tile: the MMA's N side
    if R % ROW_ALIGN:
        raise ValueError(f"the in-kernel group plan takes row tiles of a multiple of {ROW_ALIGN} (got rows={R})")
    if KH2 != KH or KH % kh or kh % BLOCK or N % COLS or bounds.shape != (E + 2,):
        raise ValueError(f"mgpu MXFP4: packed K/2={KH2} (x: {KH}) must be a multiple of kh={kh} (a multiple of "
                         f"{BLOCK}), N={N} of {COLS}; bounds {bounds.shape} must be [E + 2 = {E + 2}]")
    n_blocks = N // COLS
    decode = _bf16_decode(kh, w.layout)
    store = plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,) * 5 + (plgpu.RefType(),))(_store_direct_fn())
    scaled = row_scale is not None

    def splat(v):
        return plgpu.layout_cast(jnp.full((COLS, RX), v, jnp.int32), plgpu.Layout.WGMMA)

    def body(bounds_ref, *refs):
        if scaled:
            scale_ref, xs_ref, codes_ref, scales_ref, out_ref = refs
        else:
            xs_ref, codes_ref, scales_ref, out_ref = refs

        def tile(g, nb, x_row, lo, hi):
            """Group g's (g = E: zeros) tile at column block nb: x rows [x_row, x_row + RX) -> acc row r is out row
            x_row + r, stored where lo ≤ r < hi."""
            def store_tile(acc):  # the splats made here, after the pipeline: not live (registers) across it
                store(acc, splat(x_row), splat(lo), splat(hi), splat(nb * COLS), out_ref)

            @pl.when(g < E)
            def _matmul():
                def acc_scope(acc_ref):
                    _mma_over_k(decode, acc_ref, codes_ref.at[g], scales_ref.at[g], xs_ref, nb, pl.Element(RX), x_row,
                                cfg)
                    return acc_ref[...]

                acc = pl.run_scoped(acc_scope, plgpu.ACC((COLS, RX), jnp.float32))
                store_tile(acc * scale_ref[g] if scaled else acc)

            @pl.when(g == E)
            def _zeros():
                store_tile(plgpu.layout_cast(jnp.zeros((COLS, RX), jnp.float32), plgpu.Layout.WGMMA))

        @plgpu.nd_loop(((E + 1) * n_blocks,), collective_axes="sm")
        def _item(info):
            (i,) = info.index
            g = i // n_blocks
            start, end = bounds_ref[g], bounds_ref[g + 1]

            def next_tile(row0):  # a tile takes as many of the group's rows as its R + 8 fetched rows hold
                x_row = jax.lax.div(row0, ROW_ALIGN) * ROW_ALIGN  # a multiple of 8 the lowering can see
                first = row0 - x_row
                hi = jnp.minimum(end - x_row, RX)
                tile(g, i % n_blocks, x_row, first, hi)
                return x_row + hi

            jax.lax.while_loop(lambda row0: row0 < end, next_tile, start)

    args = (bounds, *((row_scale,) if scaled else ()), xs, w.codes, w.scales_t)
    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((out_rows or M, N), jnp.float32),
        grid=_cta_grid(cfg),
        grid_names=("sm",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )(*args)


@functools.partial(jax.jit, static_argnames=("config", "out_dtype"))
def grouped_matmul(x, w: PreparedWeight, group_sizes, *, config: MgpuConfig | None = None, out_dtype=jnp.float32):
    """`x [M, K]` bf16 rows sorted by group, MXFP4 weight (`prepare_weight`), `group_sizes [E]` -> `[M, N]`:
    x @ W[g]ᵀ per row with fp32 accumulation (the decoded weights are `mxfp4.decode_lo_hi_bf16_ref`'s bits), in
    natural column order whatever the weight's `out_order`. Rows past Σ group_sizes are zeros."""
    if x.shape[1] != w.in_features:
        raise ValueError(f"MXFP4 weight has K={w.in_features}, x has K={x.shape[1]}")
    if w.out_order == "planes":  # the kernel writes the stored column order: put the natural one back
        out = grouped_matmul(x, dataclasses.replace(w, out_order="natural"), group_sizes, config=config,
                             out_dtype=out_dtype)
        return out[:, np.argsort(planes_column_order(w.out_features))]
    config = config or config_for(x.shape[0], w)
    if config.mma == "fp8":
        x_hi, x_lo, inv, tile_group, num_tiles, pad_row, live = fp8_mma.prepare_rows_fp8(x, group_sizes, w.num_experts,
                                                                                 config.rows)
        out = fp8_mma.kernel_call_fp8(x_hi, x_lo, tile_group, num_tiles, w, config)
        return unpad_output(out, pad_row, live, out_dtype, row_scale=inv)
    elif config.mma == "bf16" and config.plan == "kernel":
        xs, bounds = prepare_grouped(x, group_sizes, config)
        return kernel_call_grouped(xs, bounds, w, config, expert_scale(w), out_rows=x.shape[0]).astype(out_dtype)
    elif config.mma == "bf16":
        xs, tile_group, num_tiles, pad_row, live = prepare_rows(x, group_sizes, w.num_experts, config.rows)
        out = kernel_call(xs, tile_group, num_tiles, w, config)
        row_scale = None
        if w.layout == "placed":  # each padded row's expert's `out_scale` (1 for real checkpoints)
            row_scale = jnp.repeat(expert_scale(w)[tile_group], config.rows)
        return unpad_output(out, pad_row, live, out_dtype, row_scale=row_scale)
    raise ValueError(f"MgpuConfig.mma must be 'bf16' or 'fp8', got {config.mma!r}")
