"""The e2m1 decode inside the Mosaic GPU MXFP4 kernels: inline Mosaic GPU bodies that turn a pipeline step's codes
smem `[64, kh]` u8 and scales smem `[kh/16, 64]` u8 into the (lo, hi) bf16 `[64, kh]` WGMMA A operands, through the
tested PTX decodes of `pallas_kernels.moe.mxfp4` (`DECODE_PTX_PLACED` for the placed layout,
`DECODE_PTX_SIGN_OPERANDS` for the natural one).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import pallas_kernels.moe.mxfp4 as mx  # not `from . import`: see moe/ops.py
from .config import BLOCK, COLS
from .layout import _fragment_slots


def _decode_fn(kh: int, code_layout: str = "natural"):
    """The inline Mosaic GPU body: (codes smem `[64, kh]` u8 in `code_layout` (`PreparedWeight.layout`), scales
    smem `[kh/16, 64]` u8) -> (lo, hi) bf16 `[64, kh]` in the WGMMA layout."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm, memref, vector
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mgu

    def fn(ctx, codes_ref, scales_ref):
        del ctx
        i8, i32 = ir.IntegerType.get_signless(8), ir.IntegerType.get_signless(32)
        index, bf16 = ir.IndexType.get(), ir.BF16Type.get()
        layout = fa.WGMMA_LAYOUT
        reg_shape, reg, rows, two_q = _fragment_slots(layout, (COLS, kh))  # reg(8-column block, row half); 2q
        assert reg_shape[1] == kh // 8 and reg_shape[4] == 2 and np.prod(reg_shape) == kh // 4, reg_shape
        q = arith.divui(two_q, mgu.c(2, index))
        q16 = arith.muli(two_q, mgu.c(8, index))
        v16i8 = ir.VectorType.get((16,), i8)
        v4i32 = ir.VectorType.get((4,), i32)
        v2bf16 = ir.VectorType.get((2,), bf16)
        out_ty = llvm.StructType.get_literal([i32] * 4)
        lo = np.empty(reg_shape, dtype=object)
        hi = np.empty(reg_shape, dtype=object)
        # the decode's constants as operands: materialised once, not once per word (`mx.DECODE_PTX_SIGN_OPERANDS`)
        pa, pb = mgu.c(mx.LUT_POS[0], i32), mgu.c(mx.LUT_POS[1], i32)
        c43 = mgu.c(0x43434343, i32)
        for h in (0, 1):
            for b in range(kh // BLOCK):
                col = arith.addi(q16, mgu.c(BLOCK * b, index))
                words = mgu.bitcast(vector.load(v16i8, codes_ref, [rows[h], col]), v4i32)
                grp = arith.addi(q, mgu.c(4 * b, index))
                s32 = arith.extui(i32, memref.load(scales_ref, [grp, rows[h]]))
                if code_layout == "placed":  # bf16x2 (h, h), h = 2^(S−1), S = 0 a zero scale (`scale_placed_bf16`)
                    h2 = arith.select(arith.cmpi(arith.CmpIPredicate.eq, s32, mgu.c(0, i32)), mgu.c(0, i32),
                                      arith.muli(arith.addi(s32, mgu.c(126, i32)), mgu.c(0x00800080, i32)))
                else:  # bf16x2 (h, h), h = 2^(S-128) (`mxfp4.scale_half_bf16`), and −192·h, once per group
                    e = arith.subi(arith.maxui(s32, mgu.c(1, i32)), mgu.c(1, i32))
                    h2 = arith.muli(e, mgu.c(0x00800080, i32))
                    c2 = llvm.inline_asm(i32, [h2], mx.NEG192_PTX, "=r,r")
                for s in range(4):
                    w = vector.extract(words, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([s]))
                    if code_layout == "placed":
                        out = llvm.inline_asm(out_ty, [w, h2], mx.DECODE_PTX_PLACED, "=r,=r,=r,=r,r,r")
                    else:
                        out = llvm.inline_asm(out_ty, [w, h2, c2, pa, pb, c43], mx.DECODE_PTX_SIGN_OPERANDS,
                                              "=r,=r,=r,=r,r,r,r,r,r,r")
                    regs = [mgu.bitcast(llvm.extractvalue(i32, out, [k]), v2bf16) for k in range(4)]
                    slab = 4 * b + s
                    lo[reg(2 * slab, h)], lo[reg(2 * slab + 1, h)] = regs[0], regs[1]
                    hi[reg(2 * slab, h)], hi[reg(2 * slab + 1, h)] = regs[2], regs[3]
        return (fa.FragmentedArray(_registers=lo, _layout=layout, _is_signed=None),
                fa.FragmentedArray(_registers=hi, _layout=layout, _is_signed=None))

    return fn


def _bf16_decode(kh: int, code_layout: str):
    """The inline decode of a step's codes and scales into the (lo, hi) bf16 WGMMA operands (`_decode_fn`)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    return plgpu.inline_mgpu(
        arg_types=(plgpu.RefType(), plgpu.RefType()),
        return_type=(plgpu.ShapeDtypeStruct((COLS, kh), jnp.bfloat16, layout=plgpu.Layout.WGMMA),
                     plgpu.ShapeDtypeStruct((COLS, kh), jnp.bfloat16, layout=plgpu.Layout.WGMMA)),
    )(_decode_fn(kh, code_layout))
