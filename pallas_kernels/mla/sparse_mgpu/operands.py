"""The wgmma operands of the Mosaic GPU sparse MLA kernel, built in registers from the gathered fp8 rows: the logits
A operand (keys as the M side, bytes converted by `cvt.rn.f16x2.e4m3x2`), the PV A operand (latent dims as the M
side, bytes of two keys paired by `prmt`), and their fp8-MMA variants.
"""

from __future__ import annotations

import numpy as np

from pallas_kernels.moe.mgpu_mxfp4 import _fragment_slots
from .config import CHUNK, HEADS, KEYS, P_SCALE
from .gather import _key_of, _mlir

# Four e4m3 bytes (one 32-bit register) -> four f16 (two registers): the hardware conversion, two per instruction.
CVT_E4M3X4_F16_PTX = """{
.reg .b16 e4lo, e4hi;
mov.b32 {e4lo, e4hi}, $2;
cvt.rn.f16x2.e4m3x2 $0, e4lo;
cvt.rn.f16x2.e4m3x2 $1, e4hi;
}"""

# keys (a, b) -> dim pairs: bytes (a0 b0 a1 b1) and (a2 b2 a3 b3), each 16-bit half one f16x2 register
_PAIR_CVT = """{
.reg .b32 t0, t1;
.reg .b16 x0, x1, x2, x3;
prmt.b32 t0, $4, $5, 0x5140;
prmt.b32 t1, $4, $5, 0x7362;
mov.b32 {x0, x1}, t0;
mov.b32 {x2, x3}, t1;
cvt.rn.f16x2.e4m3x2 $0, x0;
cvt.rn.f16x2.e4m3x2 $1, x1;
cvt.rn.f16x2.e4m3x2 $2, x2;
cvt.rn.f16x2.e4m3x2 $3, x3;
}"""


def _operand_types():
    """(i8, i32, f16, index) MLIR types of the operand builders."""
    ir = _mlir()[0]
    return ir.IntegerType.get_signless(8), ir.IntegerType.get_signless(32), ir.F16Type.get(), ir.IndexType.get()


def _row_load(vty, rows_ref, at):
    """A vector load of a thread's bytes from a gathered row in shared memory, aligned to its own size (rows start
    on 16 bytes, `row_stride`; a thread's bytes on their size). Said explicitly: LLVM otherwise infers the alignment
    from the address arithmetic, and where it cannot it splits the load into single bytes."""
    ir, _, _, _, vector, _, mgu = _mlir()
    vt = ir.VectorType(vty)
    return vector.load(vty, rows_ref, at, alignment=vt.shape[0] * mgu.bitwidth(vt.element_type) // 8)


def _logits_words(rows_ref, rows, t16, col0: int, width: int):
    """The logits operand's loads, shared by the f16 and fp8 builders: for each row half h (key rows `_key_of` of
    the thread's fragment rows) and 64-column chunk q, thread t's 16 bytes [col0 + 64q + 16t, +16) as 4 words ->
    yields (h, q, s, word s) (t16 = 16t, an index value)."""
    ir, arith, _, _, vector, _, mgu = _mlir()
    i8, i32, _, index = _operand_types()
    v16i8, v4i32 = ir.VectorType.get((16,), i8), ir.VectorType.get((4,), i32)
    keys = [_key_of(r) for r in rows]
    for h in (0, 1):
        for q in range(width // CHUNK):
            col = arith.addi(t16, mgu.c(col0 + CHUNK * q, index))
            words = mgu.bitcast(_row_load(v16i8, rows_ref, [keys[h], col]), v4i32)
            for s in range(4):
                yield h, q, s, vector.extract(words, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([s]))


def _logits_operand_fn(col0: int, width: int):
    """rows smem `[64, c]` u8 (one stage) -> the logits A operand for latent columns [col0, col0 + width):
    `[64, width]` f16 in the WGMMA layout (keys = rows; thread t's 16 bytes per 64-column chunk, word s = k-step s)."""
    def fn(ctx, rows_ref):
        del ctx
        ir, arith, llvm, _, _, fa, mgu = _mlir()
        _, i32, f16, index = _operand_types()
        layout = fa.WGMMA_LAYOUT
        reg_shape, reg, rows, two_t = _fragment_slots(layout, (KEYS, width))
        v2f16 = ir.VectorType.get((2,), f16)
        pair = llvm.StructType.get_literal([i32] * 2)
        regs = np.empty(reg_shape, dtype=object)
        for h, q, s, w in _logits_words(rows_ref, rows, arith.muli(two_t, mgu.c(8, index)), col0, width):
            out = llvm.inline_asm(pair, [w], CVT_E4M3X4_F16_PTX, "=r,=r,r")
            for e in (0, 1):
                regs[reg(8 * q + 2 * s + e, h)] = mgu.bitcast(llvm.extractvalue(i32, out, [e]), v2f16)
        return fa.FragmentedArray(_registers=regs, _layout=layout, _is_signed=None)

    return fn


def _logits_operand_fp8_fn(col0: int, width: int):
    """rows smem `[64, c]` u8 (one stage) -> the fp8 logits A operands for latent columns [col0, col0 + width): one
    `[64, 32]` e4m3 array (WGMMA_8BIT layout) per 32 columns — the stored bytes as they are, loaded 16 at a time
    (`fp8_q_permutation`'s order; the same loads and key rows as the f16 path)."""
    def fn(ctx, rows_ref):
        del ctx
        ir, arith, _, _, _, fa, mgu = _mlir()
        _, _, _, index = _operand_types()
        layout = fa.WGMMA_LAYOUT_8BIT
        reg_shape, reg, rows, four_q = _fragment_slots(layout, (KEYS, 32))
        assert reg_shape[1] == 2 and reg_shape[4] == 2 and np.prod(reg_shape) == 4, reg_shape
        v4f8 = ir.VectorType.get((4,), ir.Float8E4M3FNType.get())
        groups = [np.empty(reg_shape, dtype=object) for _ in range(width // 32)]
        for h, q, s, w in _logits_words(rows_ref, rows, arith.muli(four_q, mgu.c(4, index)), col0, width):
            groups[2 * q + s // 2][reg(s % 2, h)] = mgu.bitcast(w, v4f8)
        return tuple(fa.FragmentedArray(_registers=g, _layout=layout, _is_signed=None) for g in groups)

    return fn


def _first_dim(row0, R: int):
    """A thread's first PV row (16w + g, an index value) -> the first of its 2T contiguous latent dims,
    2T(8w + g) (`value_dim_of_row`: the operand loads them, the epilogue writes them back in natural order)."""
    ir, arith, _, _, _, _, mgu = _mlir()
    index = ir.IndexType.get()
    wg8 = arith.addi(arith.muli(arith.divui(row0, mgu.c(16, index)), mgu.c(8, index)),
                     arith.remui(row0, mgu.c(8, index)))
    return arith.muli(wg8, mgu.c(2 * (R // 64), index))


def _value_slots(layout, R: int, ncols: int):
    """A PV A operand's registers for one thread (`[R, ncols]`, WGMMA or WGMMA_8BIT layout): (registers shape,
    `reg(i, block, half)` -> a register index, the first of the thread's 2T contiguous latent dims, the first column
    of its block-0 register, and the vector types of one load of those dims: 2T bytes, as 2T / 4 words)."""
    ir, _, _, _, _, _, _ = _mlir()
    i8, i32, _, _ = _operand_types()
    reg_shape = layout.registers_shape((R, ncols))
    coords = dict(zip(np.ndindex(reg_shape), layout.thread_idxs((R, ncols))))

    def reg(i, blk, h):
        ix = [0] * len(reg_shape)
        ix[0], ix[1], ix[4] = i, blk, h
        return tuple(ix)

    row0, col0 = coords[reg(0, 0, 0)]  # 16w + g and the thread's first column
    nbytes = R // 32
    return (reg_shape, reg, _first_dim(row0, R), col0, ir.VectorType.get((nbytes,), i8),
            ir.VectorType.get((nbytes // 4,), i32))


def _value_operand_fn(R: int, key0: int, nkeys: int):
    """rows smem `[64, c]` u8 -> the PV A operand Vᵀ for keys [key0, key0 + nkeys): `[R, nkeys]` f16 in the WGMMA
    layout (rows = latent dims in `value_dim_of_row` order, columns = keys in order)."""
    nbytes = R // 32  # the thread's 2T dims

    def fn(ctx, rows_ref):
        del ctx
        ir, arith, llvm, _, vector, fa, mgu = _mlir()
        _, i32, f16, index = _operand_types()
        layout = fa.WGMMA_LAYOUT
        reg_shape, reg, dim0, two_t, vload, vword = _value_slots(layout, R, nkeys)  # two_t: 2t
        v2f16 = ir.VectorType.get((2,), f16)
        quad = llvm.StructType.get_literal([i32] * 4)
        regs = np.empty(reg_shape, dtype=object)
        for s in range(nkeys // 16):
            for a in (0, 1):
                pa = arith.addi(two_t, mgu.c(key0 + 16 * s + 8 * a, index))  # K position of the pair (2t, 2t+1)
                ka, kb = _key_of(pa), _key_of(arith.addi(pa, mgu.c(1, index)))
                wa = mgu.bitcast(_row_load(vload, rows_ref, [ka, dim0]), vword)
                wb = mgu.bitcast(_row_load(vload, rows_ref, [kb, dim0]), vword)
                for u in range(nbytes // 4):
                    pos = ir.DenseI64ArrayAttr.get([u])
                    xa = vector.extract(wa, dynamic_position=[], static_position=pos)
                    xb = vector.extract(wb, dynamic_position=[], static_position=pos)
                    out = llvm.inline_asm(quad, [xa, xb], _PAIR_CVT, "=r,=r,=r,=r,r,r")
                    for k, (i, h) in enumerate(((2 * u, 0), (2 * u, 1), (2 * u + 1, 0), (2 * u + 1, 1))):
                        regs[reg(i, 2 * s + a, h)] = mgu.bitcast(llvm.extractvalue(i32, out, [k]), v2f16)
        return fa.FragmentedArray(_registers=regs, _layout=layout, _is_signed=None)

    return fn


# 4 keys' words a, b, c, d (byte j = dim j) -> 4 words (byte e = key e) for dims 0..3
_TRANSPOSE4 = """{
.reg .b32 t0, t1, t2, t3;
prmt.b32 t0, $4, $5, 0x5140;
prmt.b32 t1, $4, $5, 0x7362;
prmt.b32 t2, $6, $7, 0x5140;
prmt.b32 t3, $6, $7, 0x7362;
prmt.b32 $0, t0, t2, 0x5410;
prmt.b32 $1, t0, t2, 0x7632;
prmt.b32 $2, t1, t3, 0x5410;
prmt.b32 $3, t1, t3, 0x7632;
}"""


# x (f32) -> hi = e4m3(x) in byte 0, lo = e4m3(x − hi) in byte 2
_SPLIT_E4M3 = """{
.reg .b16 h, l, hz;
.reg .b32 hf;
.reg .f32 z, hv, r;
.reg .f16 h16;
mov.f32 z, 0f00000000;
cvt.rn.satfinite.e4m3x2.f32 h, z, $1;
cvt.rn.f16x2.e4m3x2 hf, h;
mov.b32 {h16, hz}, hf;
cvt.f32.f16 hv, h16;
sub.f32 r, $1, hv;
cvt.rn.satfinite.e4m3x2.f32 l, z, r;
mov.b32 $0, {h, l};
}"""


def _value_operand_fp8_fn(R: int, group: int):
    """rows smem `[64, c]` u8 -> the fp8 PV A operand Vᵀ for contraction positions [32·group, +32): `[R, 32]` e4m3
    (WGMMA_8BIT layout; rows = latent dims in `value_dim_of_row` order, columns = positions, keys `pv_key_of`).
    Thread q of a quad loads its 2T contiguous dims of the keys at its positions 4q..4q+3 (+16), then 4×4 byte
    transposes turn 4 keys × 4 dims into 4 registers of one dim × 4 keys."""
    nbytes = R // 32  # the thread's 2T dims

    def fn(ctx, rows_ref):
        del ctx
        ir, arith, llvm, _, vector, fa, mgu = _mlir()
        _, i32, _, index = _operand_types()
        f8 = ir.Float8E4M3FNType.get()
        layout = fa.WGMMA_LAYOUT_8BIT
        reg_shape, reg, dim0, four_q, vload, vword = _value_slots(layout, R, 32)  # four_q: 4q
        quad = arith.divui(four_q, mgu.c(4, index))
        v4f8 = ir.VectorType.get((4,), f8)
        quad_ty = llvm.StructType.get_literal([i32] * 4)
        regs = np.empty(reg_shape, dtype=object)
        for blk in (0, 1):
            base = 32 * group + 16 * blk  # positions base + 4q + e hold keys base + 4e + q
            words = [mgu.bitcast(_row_load(vload, rows_ref, [arith.addi(quad, mgu.c(base + 4 * e, index)), dim0]),
                                 vword) for e in range(4)]
            for u in range(nbytes // 4):
                pos = ir.DenseI64ArrayAttr.get([u])
                x = [vector.extract(w, dynamic_position=[], static_position=pos) for w in words]
                out = llvm.inline_asm(quad_ty, x, _TRANSPOSE4, "=r,=r,=r,=r,r,r,r,r")
                for v in range(4):  # dim 4u + v of the thread's 2T: tile i = (4u + v) // 2, half h = v % 2
                    regs[reg((4 * u + v) // 2, blk, v % 2)] = mgu.bitcast(llvm.extractvalue(i32, out, [v]), v4f8)
        return fa.FragmentedArray(_registers=regs, _layout=layout, _is_signed=None)

    return fn


def _store_p_fp8_fn():
    """(P `[64, 16]` f32 in the WGMMA layout — logits rows m, key `_key_of(m)` —, P planes smem hi, lo `[16, 64]`
    e4m3 in `_q_fp8_transforms`' layout (tiled 8 × 32, 32-byte swizzle)): P · 2^8 split into e4m3 hi + lo, each
    value stored at head n, contraction position `pv_key_of`⁻¹(key) = pv_key_of(key). Callers commit_smem after."""
    def fn(ctx, p, hi_ref, lo_ref):
        del ctx
        ir, arith, llvm, memref, vector, fa, mgu = _mlir()
        f32, i8, i32 = ir.F32Type.get(), ir.IntegerType.get_signless(8), ir.IntegerType.get_signless(32)
        index = ir.IndexType.get()
        f8 = ir.Float8E4M3FNType.get()
        ci = lambda v: mgu.c(v, index)  # noqa: E731
        _, reg, rows, col0 = _fragment_slots(fa.WGMMA_LAYOUT, (KEYS, HEADS))
        for h in (0, 1):
            key = _key_of(rows[h])
            pos = arith.addi(arith.addi(arith.muli(arith.divui(key, ci(16)), ci(16)),
                                        arith.muli(arith.remui(key, ci(4)), ci(4))),
                             arith.divui(arith.remui(key, ci(16)), ci(4)))  # pv_key_of(key)
            pt, pc = arith.divui(pos, ci(32)), arith.remui(pos, ci(32))
            for cb in range(2):
                vals = p.registers[reg(cb, h)]
                for e in (0, 1):
                    head = arith.addi(col0, ci(8 * cb + e))
                    nrow = arith.remui(head, ci(8))
                    # 32-byte swizzle: the 16-byte half of a 32-byte tile row flips on the row's bit 2
                    col = arith.xori(pc, arith.muli(arith.divui(nrow, ci(4)), ci(16)))
                    at = [arith.divui(head, ci(8)), pt, nrow, col]
                    x = vector.extract(vals, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([e]))
                    x = arith.mulf(x, mgu.c(P_SCALE, f32))
                    both = llvm.inline_asm(i32, [x], _SPLIT_E4M3, "=r,f")
                    memref.store(arith.bitcast(f8, arith.trunci(i8, both)), hi_ref, at)
                    memref.store(arith.bitcast(f8, arith.trunci(i8, arith.shrui(both, mgu.c(16, i32)))), lo_ref, at)

    return fn
