"""Experimental: MXFP4 codes on fp8 tensor cores (`MgpuConfig(mma="fp8")`), measured slower than the bf16 decode.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import pallas_kernels.moe.mxfp4 as mx  # not `from . import`: see moe/ops.py
from pallas_kernels.moe.mgpu_mxfp4.config import COLS, MgpuConfig
from pallas_kernels.moe.mgpu_mxfp4.kernels import _for_each_item, _launch, _store_tile
from pallas_kernels.moe.mgpu_mxfp4.layout import PreparedWeight, _fragment_slots
from pallas_kernels.moe.mgpu_mxfp4.rows import _pad_rows


def _decode_fp8_fn(kh: int):
    """The inline Mosaic GPU body of the fp8 path: codes smem `[64, kh]` u8 -> one e4m3 array `[64, 32]` per
    32-element group (WGMMA_8BIT layout: thread q holds columns 4q..4q+3 and 16+4q..16+4q+3 of rows r, r + 8).
    Columns 0..15 are the group's even elements (low nibbles), 16..31 its odd ones; thread q's word is the 4 bytes
    [4q, 4q + 4) of the group's 16 — the natural order, so x needs only its [even | odd] split per group."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm, vector
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mgu

    def fn(ctx, codes_ref):
        del ctx
        i8, i32 = ir.IntegerType.get_signless(8), ir.IntegerType.get_signless(32)
        index, f8 = ir.IndexType.get(), ir.Float8E4M3FNType.get()
        layout = fa.WGMMA_LAYOUT_8BIT
        reg_shape, reg, rows, four_q = _fragment_slots(layout, (COLS, mx.GROUP))  # reg(16-column block, half); 4q
        assert reg_shape[1] == 2 and reg_shape[4] == 2 and np.prod(reg_shape) == 4, reg_shape
        v4i8, v4f8 = ir.VectorType.get((4,), i8), ir.VectorType.get((4,), f8)
        out_ty = llvm.StructType.get_literal([i32] * 2)
        planes = []
        for grp in range(kh // (mx.GROUP // 2)):
            regs = np.empty(reg_shape, dtype=object)
            col = arith.addi(four_q, mgu.c(grp * (mx.GROUP // 2), index))
            for h in (0, 1):
                word = mgu.bitcast(vector.load(v4i8, codes_ref, [rows[h], col]), i32)
                out = llvm.inline_asm(out_ty, [word], mx.DECODE_E4M3_PTX, "=r,=r,r")
                regs[reg(0, h)] = mgu.bitcast(llvm.extractvalue(i32, out, [0]), v4f8)  # low nibbles: even elements
                regs[reg(1, h)] = mgu.bitcast(llvm.extractvalue(i32, out, [1]), v4f8)  # high nibbles: odd elements
            planes.append(fa.FragmentedArray(_registers=regs, _layout=layout, _is_signed=None))
        return tuple(planes)

    return fn


def _fold_fn(ng: int):
    """The inline Mosaic GPU body that folds a step's per-group partials: (out, part_0 … part_{ng−1} `[64, R]` f32,
    scales smem `[ng, 64]` u8) -> out + Σ_g part_g · 2^(S[g, row] − 127 + 6), the scale per output column (row of
    the transposed product)."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, memref, vector
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mgu

    def fn(ctx, out, *args):
        del ctx
        *parts, scales_ref = args
        i32, f32, index = ir.IntegerType.get_signless(32), ir.F32Type.get(), ir.IndexType.get()
        layout = out.layout
        rows = [idx[0] for idx in layout.thread_idxs(out.shape)]
        regs = out.registers.copy()
        flat = list(np.ndindex(regs.shape))
        for j, part in enumerate(parts):
            assert part.layout == layout, (part.layout, layout)
            for k, ri in enumerate(flat):
                s32 = arith.extui(i32, memref.load(scales_ref, [mgu.c(j, index), rows[k]]))
                e = arith.shli(arith.addi(s32, mgu.c(mx.E4M3_DECODE_EXP, i32)), mgu.c(23, i32))
                sc = arith.bitcast(f32, e)
                vt = regs[ri].type
                sc_v = vector.broadcast(vt, sc) if isinstance(vt, ir.VectorType) else sc
                regs[ri] = arith.addf(regs[ri], arith.mulf(part.registers[ri], sc_v))
        return fa.FragmentedArray(_registers=regs, _layout=layout, _is_signed=None)

    return fn


def prepare_rows_fp8(x, group_sizes, num_experts: int, rows: int = 16):
    """XLA side of the fp8 path: `_pad_rows`, each 32-element group's even elements then its odd ones (the order of
    the decoded codes), as two e4m3 planes -> (x_hi, x_lo `[m_pad, K]`, 1/row scale `[m_pad]`, tile -> group, live
    tiles, padded row of each input row, live row mask). x ≈ (x_hi + x_lo)·inv (`mxfp4.split_e4m3_planes`)."""
    x_rows, tile_group, num_tiles, pad_row, live = _pad_rows(x, group_sizes, num_experts, rows)
    m_pad, K = x_rows.shape
    g = mx.GROUP
    x_rows = x_rows.reshape(m_pad, K // g, g // 2, 2).transpose(0, 1, 3, 2).reshape(m_pad, K)
    x_hi, x_lo, inv = mx.split_e4m3_planes(x_rows)
    return x_hi, x_lo, inv, tile_group, num_tiles, pad_row, live


def kernel_call_fp8(x_hi, x_lo, tile_group, num_tiles, w: PreparedWeight, config: MgpuConfig):
    """The fp8 path's kernel: `prepare_rows_fp8`' planes and the weight -> out `[m_pad, N]` fp32, still to be
    multiplied by each row's `inv`. Per step and 32-element group g: acc_g = W_g(e4m3, 2^-6·e2m1) · (x_hi + x_lo)_g
    on fresh accumulators, then out += acc_g · 2^(S_g − 127 + 6) per output column (the scale is per weight row)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    m_pad, K = x_hi.shape
    cfg = config
    R, kh = cfg.rows, cfg.kh
    t_max = m_pad // R
    E, N, KH = w.codes.shape
    if w.layout != "natural":
        raise ValueError(f"the fp8 path decodes natural codes: prepare the weight with layout='natural', not "
                         f"{w.layout!r}")
    if 2 * KH != K or KH % kh or kh % 16 or N % COLS or m_pad % R or R % 8:
        raise ValueError(f"mgpu MXFP4 fp8: packed K/2={KH} (x: K={K}) must be a multiple of kh={kh} (a multiple of "
                         f"16), N={N} of {COLS}, padded rows {m_pad} of rows={R} (a multiple of 8)")
    G = mx.GROUP
    ng = kh // (G // 2)
    n_blocks = N // COLS
    k_steps = KH // kh
    decode = plgpu.inline_mgpu(
        arg_types=(plgpu.RefType(),),
        return_type=tuple(plgpu.ShapeDtypeStruct((COLS, G), jnp.float8_e4m3fn, layout=plgpu.Layout.WGMMA_8BIT)
                          for _ in range(ng)),
    )(_decode_fp8_fn(kh))
    acc_ty = plgpu.ShapeDtypeStruct((COLS, R), jnp.float32, layout=plgpu.Layout.WGMMA)
    fold = plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, *[plgpu.Layout.WGMMA] * ng, plgpu.RefType()),
                             return_type=acc_ty)(_fold_fn(ng))
    # 32-byte rows of x per group: the wgmma's K (32 e4m3) must be one swizzle width
    x_transforms = (plgpu.TilingTransform((8, G)), plgpu.SwizzleTransform(G))

    def body(tile_group_ref, num_ref, xh_ref, xl_ref, codes_ref, scales_ref, out_ref, o_smem):
        def item(t, nb, g):
            def step(_, codes_s, scales_s, xh_s, xl_s, out):
                w_groups = decode(codes_s)

                def mma(*acc_refs):
                    for j, acc_ref in enumerate(acc_refs):
                        xk = pl.ds(j * G, G)
                        plgpu.wgmma(acc_ref, w_groups[j], plgpu.transpose_ref(xh_s.at[:, xk], (1, 0)))
                        plgpu.wgmma(acc_ref, w_groups[j], plgpu.transpose_ref(xl_s.at[:, xk], (1, 0)))
                    return [a[...] for a in acc_refs]

                parts = pl.run_scoped(mma, *[plgpu.ACC((COLS, R), jnp.float32) for _ in range(ng)])
                return fold(out, *parts, scales_s)

            zeros = plgpu.layout_cast(jnp.zeros((COLS, R), jnp.float32), plgpu.Layout.WGMMA)
            acc = plgpu.emit_pipeline(
                step,
                grid=(k_steps,),
                in_specs=[
                    plgpu.BlockSpec((COLS, kh), lambda kk: (nb, kk)),
                    plgpu.BlockSpec((ng, COLS), lambda kk: (kk, nb)),
                    plgpu.BlockSpec((R, 2 * kh), lambda kk: (t, kk), transforms=x_transforms),
                    plgpu.BlockSpec((R, 2 * kh), lambda kk: (t, kk), transforms=x_transforms),
                ],
                max_concurrent_steps=cfg.steps,
                init_carry=zeros,
            )(codes_ref.at[g], scales_ref.at[g], xh_ref, xl_ref)
            _store_tile(acc, o_smem, out_ref, nb, t, "rows")

        _for_each_item(t_max, n_blocks, tile_group_ref, num_ref, item)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return _launch(body, N, m_pad, cfg)(tile_group, num_tiles, x_hi, x_lo, w.codes, w.scales_t)
