"""The arithmetic of the Mosaic GPU sparse MLA kernel: block softmax in the log2 domain with running (max, sum),
the split's finish, the exact log-sum-exp merge of splits (`_combine_fn`, `_last_merge_fn`) and q's in-kernel
preparation (`_prep_q_fn`: the same bits as `prep.prepare_q`).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from pallas_kernels.moe.mgpu_mxfp4 import _fragment_slots
from .config import HEADS, KEYS, LN2, LOG2E
from .gather import _asm, _key_of, _mlir, _scalar, _thread_in_cta, _thread_in_wg
from .operands import _first_dim


def _approx(op: str, x):
    """`op`.approx.ftz.f32 ("ex2": 2^x, −inf -> 0; "lg2": log2 x) on an f32 scalar or on each element of a vector."""
    ir, _, llvm, _, vector, _, _ = _mlir()
    f32 = ir.F32Type.get()
    one = lambda v: llvm.inline_asm(f32, [v], f"{op}.approx.ftz.f32 $0, $1;", "=f,f")  # noqa: E731
    if not isinstance(x.type, ir.VectorType):
        return one(x)
    n = ir.VectorType(x.type).shape[0]
    return vector.from_elements(x.type, [one(vector.extract(x, dynamic_position=[],
                                                            static_position=ir.DenseI64ArrayAttr.get([e])))
                                         for e in range(n)])


def _warpgroup_reduce(vals, red_ref, rows0, col0, combine):
    """vals [2] vector<2xf32> (heads col0 + 8c, +1) -> the same reduced over the warpgroup's 128 threads: over the
    8 row groups of a warp by butterfly shuffles, over the 4 warps through red_ref `[4, 16]` f32 (one barrier)."""
    ir, arith, _, _, vector, _, mgu = _mlir()
    index = ir.IndexType.get()
    v2 = ir.VectorType.get((2,), ir.F32Type.get())
    for d in (4, 8, 16):
        vals = [combine(v, mgu.shfl_bfly(v, d)) for v in vals]
    w = arith.divui(rows0, mgu.c(16, index))
    g0 = arith.cmpi(arith.CmpIPredicate.eq, arith.remui(rows0, mgu.c(8, index)), mgu.c(0, index))
    with mgu.when(g0):
        for cb, v in enumerate(vals):
            vector.store(v, red_ref, [w, arith.addi(col0, mgu.c(8 * cb, index))])
    mgu.warpgroup_barrier()
    out = []
    for cb in range(2):
        col = arith.addi(col0, mgu.c(8 * cb, index))
        parts = [vector.load(v2, red_ref, [mgu.c(ww, index), col]) for ww in range(4)]
        out.append(functools.reduce(combine, parts))
    return out


def _softmax_fn(R: int, p_f32: bool = False):
    """One block's online softmax: (Sᵀ `[64, 16]` f32, stats `[64, 16]` f32 (registers (c, 0): running max m,
    (c, 1): this thread's partial row sum l, both in log2 units), outᵀ `[R, 16]` f32, the block's pool rows
    `[64]` i32 smem, the cross-warp buffer `[4, 16]` f32 smem, c2 `[16]` f32 smem) -> (Pᵀ `[64, 16]` f16, stats,
    outᵀ rescaled). Empty slots (row < 0) get p = 0."""
    def fn(ctx, s_t, stats, out, idx_ref, red_ref, c2_ref):
        del ctx
        ir, arith, _, memref, vector, fa, mgu = _mlir()
        f32, f16, i32 = ir.F32Type.get(), ir.F16Type.get(), ir.IntegerType.get_signless(32)
        index = ir.IndexType.get()
        v2, v2f16 = ir.VectorType.get((2,), f32), ir.VectorType.get((2,), f16)
        layout = fa.WGMMA_LAYOUT
        _, reg, rows, col0 = _fragment_slots(layout, (KEYS, HEADS))
        neg_inf = vector.broadcast(v2, mgu.c(-math.inf, f32))
        zero = vector.broadcast(v2, mgu.c(0.0, f32))
        c2 = [vector.load(v2, c2_ref, [arith.addi(col0, mgu.c(8 * cb, index))]) for cb in range(2)]
        valid = [arith.cmpi(arith.CmpIPredicate.sge, memref.load(idx_ref, [_key_of(rows[h])]), mgu.c(0, i32))
                 for h in (0, 1)]
        x = [[arith.select(valid[h], arith.mulf(s_t.registers[reg(cb, h)], c2[cb]), neg_inf) for cb in range(2)]
             for h in (0, 1)]
        block_max = _warpgroup_reduce([arith.maximumf(x[0][cb], x[1][cb]) for cb in range(2)], red_ref, rows[0],
                                      col0, arith.maximumf)
        st = stats.registers.copy()
        corr, m_use = [], []
        for cb in range(2):
            m_old = st[reg(cb, 0)]
            m_new = arith.maximumf(m_old, block_max[cb])
            mu = arith.select(arith.cmpf(arith.CmpFPredicate.OEQ, m_new, neg_inf), zero, m_new)
            corr.append(_approx("ex2", arith.subf(m_old, mu)))
            m_use.append(mu)
            st[reg(cb, 0)] = m_new
        p_regs = np.empty(s_t.registers.shape, dtype=object)
        for cb in range(2):
            p = [_approx("ex2", arith.subf(x[h][cb], m_use[cb])) for h in (0, 1)]
            st[reg(cb, 1)] = arith.addf(arith.mulf(st[reg(cb, 1)], corr[cb]), arith.addf(p[0], p[1]))
            for h in (0, 1):
                p_regs[reg(cb, h)] = p[h] if p_f32 else arith.truncf(v2f16, p[h])
        o_regs = out.registers.copy()
        for ri in np.ndindex(o_regs.shape):
            o_regs[ri] = arith.mulf(o_regs[ri], corr[ri[1]])
        return (fa.FragmentedArray(_registers=p_regs, _layout=layout, _is_signed=None),
                fa.FragmentedArray(_registers=st, _layout=layout, _is_signed=None),
                fa.FragmentedArray(_registers=o_regs, _layout=layout, _is_signed=None))

    return fn


def _init_stats_fn():
    def fn(ctx):
        del ctx
        ir, _, _, _, vector, fa, mgu = _mlir()
        f32 = ir.F32Type.get()
        v2 = ir.VectorType.get((2,), f32)
        layout = fa.WGMMA_LAYOUT
        reg_shape, reg, _, _ = _fragment_slots(layout, (KEYS, HEADS))
        regs = np.empty(reg_shape, dtype=object)
        for cb in range(2):
            regs[reg(cb, 0)] = vector.broadcast(v2, mgu.c(-math.inf, f32))
            regs[reg(cb, 1)] = vector.broadcast(v2, mgu.c(0.0, f32))
        return fa.FragmentedArray(_registers=regs, _layout=layout, _is_signed=None)

    return fn


def _finish_fn(R: int, to_smem: bool = False, out_scale: float = 1.0):
    """(stats, outᵀ `[R, 16]` f32, cross-warp buffer, o gmem `[16, R]` f32, lse gmem `[16]` f32): the row sums
    reduced over the warpgroup, o = outᵀ · out_scale / l written straight from registers in natural dim order, lse =
    (m + log2 l)·ln 2 (−inf where l = 0, o = 0 there). `to_smem`: o_ref is instead a shared-memory byte buffer
    (this warpgroup's stages, ≥ 64·R bytes) that receives o `[16, R]` f32 row-major, and lse_ref a `[16]` f32
    shared-memory row (`_combine_fn` reads both)."""
    def fn(ctx, stats, out, red_ref, o_ref, lse_ref):
        del ctx
        ir, arith, llvm, _, vector, fa, mgu = _mlir()
        f32 = ir.F32Type.get()
        index = ir.IndexType.get()
        v2 = ir.VectorType.get((2,), f32)
        layout = fa.WGMMA_LAYOUT
        _, reg, rows, col0 = _fragment_slots(layout, (KEYS, HEADS))
        neg_inf = vector.broadcast(v2, mgu.c(-math.inf, f32))
        zero = vector.broadcast(v2, mgu.c(0.0, f32))
        one = vector.broadcast(v2, mgu.c(1.0, f32))
        l = _warpgroup_reduce([stats.registers[reg(cb, 1)] for cb in range(2)], red_ref, rows[0], col0, arith.addf)
        inv, lse = [], []
        for cb in range(2):
            good = arith.cmpf(arith.CmpFPredicate.OGT, l[cb], zero)
            l_safe = arith.select(good, l[cb], one)
            inv.append(arith.select(good, arith.divf(vector.broadcast(v2, mgu.c(out_scale, f32)), l_safe), zero))
            m = stats.registers[reg(cb, 0)]
            m = arith.select(arith.cmpf(arith.CmpFPredicate.OEQ, m, neg_inf), zero, m)
            ln2 = vector.broadcast(v2, mgu.c(LN2, f32))
            lse.append(arith.select(good, arith.mulf(arith.addf(m, _approx("lg2", l_safe)), ln2), neg_inf))
        # register (i, cb, h) of outᵀ holds dim d0 + 2i + h (`value_dim_of_row`) for heads col0 + 8cb + (0, 1): the
        # two halves h are adjacent dims, stored as one 8-byte write per head into o `[16, R]` (natural order)
        T = R // 64
        d0 = _first_dim(rows[0], R)
        o_reg_shape = layout.registers_shape((R, HEADS))
        base = mgu.memref_ptr(o_ref) if to_smem else None
        ix = lambda i, cb, h: tuple([i, cb] + [0] * 2 + [h] + [0] * (len(o_reg_shape) - 5))  # noqa: E731
        for i in range(T):
            dim = arith.addi(d0, mgu.c(2 * i, index))
            for cb in range(2):
                halves = [arith.mulf(out.registers[ix(i, cb, h)], inv[cb]) for h in (0, 1)]
                for e in (0, 1):
                    pos = ir.DenseI64ArrayAttr.get([e])
                    pair = vector.from_elements(v2, [vector.extract(x, dynamic_position=[], static_position=pos)
                                                     for x in halves])
                    head = arith.addi(col0, mgu.c(8 * cb + e, index))
                    if to_smem:
                        off = arith.muli(arith.addi(arith.muli(head, mgu.c(R, index)), dim), mgu.c(4, index))
                        ptr = mgu.getelementptr(base, [arith.index_cast(ir.IntegerType.get_signless(32), off)],
                                                ir.IntegerType.get_signless(8))
                        llvm.store(pair, ptr, alignment=8)
                    else:
                        vector.store(pair, o_ref, [head, dim])
        first = arith.cmpi(arith.CmpIPredicate.ult, rows[0], mgu.c(8, index))  # warp 0, row group 0: (w, g) = 0
        first = arith.andi(first, arith.cmpi(arith.CmpIPredicate.eq, rows[0], mgu.c(0, index)))
        with mgu.when(first):
            for cb in range(2):
                vector.store(lse[cb], lse_ref, [arith.addi(col0, mgu.c(8 * cb, index))])

    return fn


def _merge_coefs(lses, scale):
    """Partials' lse values (f32 scalars, natural log) and an output scale -> (each partial's coefficient
    w_i · scale / Σ w, the merged lse), `reference.merge_partials`' maths; no mass at all: coefficients 0, lse −inf."""
    ir, arith, _, _, _, _, mgu = _mlir()
    f32 = ir.F32Type.get()
    neg_inf, zero, one = (mgu.c(v, f32) for v in (-math.inf, 0.0, 1.0))
    m = functools.reduce(arith.maximumf, lses)
    m = arith.select(arith.cmpf(arith.CmpFPredicate.OEQ, m, neg_inf), zero, m)
    ws = [_approx("ex2", arith.mulf(arith.subf(x, m), mgu.c(LOG2E, f32))) for x in lses]
    tot = functools.reduce(arith.addf, ws)
    good = arith.cmpf(arith.CmpFPredicate.OGT, tot, zero)
    inv = arith.select(good, arith.divf(scale, arith.select(good, tot, one)), zero)
    lg = _approx("lg2", arith.select(good, tot, one))
    lse = arith.select(good, arith.addf(m, arith.mulf(lg, mgu.c(LN2, f32))), neg_inf)
    return [arith.mulf(w, inv) for w in ws], lse


def _combine_fn(R: int, nw: int, wg_bytes: int):
    """After every warpgroup's `_finish_fn(to_smem=True)` and a CTA barrier: warpgroup wg merges heads
    [wg·16/nw, (wg + 1)·16/nw) of the nw partials (o `[16, R]` f32 at byte wg'·wg_bytes of the stage buffer,
    lse `[nw, 16]` f32) exactly as `reference.merge_partials`, into o gmem `[16, R]` and lse gmem `[16]`; each thread
    owns R / 128 adjacent dims of every head."""
    dpt = R // 128
    hpw = HEADS // nw

    def fn(ctx, stage_ref, lse_parts_ref, o_ref, lse_ref, wg):
        del ctx
        ir, arith, llvm, memref, vector, _, mgu = _mlir()
        f32, i8, i32 = ir.F32Type.get(), ir.IntegerType.get_signless(8), ir.IntegerType.get_signless(32)
        index = ir.IndexType.get()
        vty = ir.VectorType.get((dpt,), f32)
        wg = arith.index_cast(index, _scalar(wg))
        tid = arith.index_cast(index, _thread_in_wg())
        dim = arith.muli(tid, mgu.c(dpt, index))
        base = mgu.memref_ptr(stage_ref)
        for hh in range(hpw):
            head = arith.addi(arith.muli(wg, mgu.c(hpw, index)), mgu.c(hh, index))
            lses = [memref.load(lse_parts_ref, [mgu.c(i, index), head]) for i in range(nw)]
            coefs, lse = _merge_coefs(lses, mgu.c(1.0, f32))
            acc = None
            for i, coef in enumerate(coefs):
                off = arith.muli(arith.addi(arith.muli(head, mgu.c(R, index)), dim), mgu.c(4, index))
                off = arith.addi(off, mgu.c(i * wg_bytes, index))
                part = llvm.load(vty, mgu.getelementptr(base, [arith.index_cast(i32, off)], i8), alignment=4 * dpt)
                term = arith.mulf(part, vector.broadcast(vty, coef))
                acc = term if acc is None else arith.addf(acc, term)
            vector.store(acc, o_ref, [head, dim])
            with mgu.when(arith.cmpi(arith.CmpIPredicate.eq, tid, mgu.c(0, index))):
                memref.store(lse, lse_ref, [head])

    return fn


def _prep_q_fn(c: int, H: int, nw: int):
    """`prepare_q` inside the kernel: raw q smem (f32 or bf16, this sequence's `[H, c]` row-major in any 2-D shape:
    TMA boxes are ≤ 256 wide) and the logit scale (gmem `[1]` f32: scale · layer scale) -> q smem `[16, c]` f16 in
    the contraction order (in `_q_transforms`' tiled, swizzled layout) and c2 smem `[16]` f32; heads ≥ H are zeros
    with c2 = log2 e. Warp v of the CTA's 4·nw warps takes heads v, v + 4·nw, …: lane l reads columns
    32i + l (i < c / 32), the head's max |q| is a butterfly over the warp, and each value is written to
    `q_column_of(i, l)`. Ends with the async-proxy fence and a CTA barrier (the wgmma reads q)."""
    nwarps = 4 * nw
    if c % 64:
        raise ValueError(f"in-kernel q preparation needs c % 64 == 0, got {c}")

    def fn(ctx, qraw_ref, q_ref, c2_ref, qs_ref, *wg):
        del ctx
        from jax._src.lib.mlir.dialects import gpu, math as mlir_math
        ir, arith, llvm, memref, _, _, mgu = _mlir()
        f32, f16, i32 = ir.F32Type.get(), ir.F16Type.get(), ir.IntegerType.get_signless(32)
        el_ty = ir.MemRefType(qraw_ref.type).element_type
        nbytes = 4 if el_ty == f32 else 2
        base = mgu.memref_ptr(qraw_ref)
        index = ir.IndexType.get()
        void = ir.Type.parse("!llvm.void")
        tid = _thread_in_cta(wg)
        lane, warp = arith.remui(tid, mgu.c(32, index)), arith.divui(tid, mgu.c(32, index))
        ci = lambda v: mgu.c(v, index)  # noqa: E731
        # _q_lane_part in index arithmetic
        quad, s4, t4 = arith.divui(lane, ci(16)), arith.remui(arith.divui(lane, ci(4)), ci(4)), arith.remui(lane, ci(4))
        lane_part = arith.addi(arith.addi(arith.muli(s4, ci(16)), arith.muli(quad, ci(2))),
                               arith.addi(arith.remui(t4, ci(2)), arith.muli(arith.divui(t4, ci(2)), ci(8))))
        qscale = memref.load(qs_ref, [ci(0)])
        zero = mgu.c(0.0, f32)
        for j in range(-(-HEADS // nwarps)):
            head = arith.addi(warp, ci(nwarps * j))
            with mgu.when(arith.cmpi(arith.CmpIPredicate.ult, head, ci(HEADS))):
                real = arith.cmpi(arith.CmpIPredicate.ult, head, ci(H))
                src = arith.minui(head, ci(H - 1))
                mult = arith.select(real, qscale, zero)  # padded heads: zeros (max 0 -> power 1)
                xs = []
                row0 = arith.addi(arith.muli(src, ci(c)), lane)  # element offset of column `lane` in q[src]
                for i in range(c // 32):
                    off = arith.index_cast(i32, arith.muli(arith.addi(row0, ci(32 * i)), ci(nbytes)))
                    v = llvm.load(el_ty, mgu.getelementptr(base, [off], ir.IntegerType.get_signless(8)))
                    v = v if el_ty == f32 else arith.extf(f32, v)
                    xs.append(arith.mulf(v, mult))
                m = functools.reduce(arith.maximumf, [mlir_math.absf(x) for x in xs])
                for d in (16, 8, 4, 2, 1):
                    m = arith.maximumf(m, mgu.shfl_bfly(m, d))
                # `gpu_prep.pow2_at_least`: 2^(e + 1) for m's exponent bits e, 1 where m = 0
                e = arith.andi(arith.shrui(arith.bitcast(i32, m), mgu.c(23, i32)), mgu.c(0xFF, i32))
                p2 = arith.bitcast(f32, arith.shli(arith.addi(e, mgu.c(1, i32)), mgu.c(23, i32)))
                p2 = arith.select(arith.cmpf(arith.CmpFPredicate.OGT, m, zero), p2, mgu.c(1.0, f32))
                # q smem is tiled (8 heads, 64 columns) with the 128-byte swizzle: in each tile row the 16-byte chunk
                # index (8 f16) is XORed with the row (the address bits the wgmma descriptor and TMA use)
                h_tile, h_row = arith.divui(head, ci(8)), arith.remui(head, ci(8))
                for i, x in enumerate(xs):
                    cc = arith.addi(lane_part, ci(4 * (i % 2)))  # column in the 64-column tile i // 2
                    chunk = arith.xori(arith.divui(cc, ci(8)), h_row)
                    phys = arith.addi(arith.muli(chunk, ci(8)), arith.remui(cc, ci(8)))
                    memref.store(arith.truncf(f16, arith.divf(x, p2)), q_ref, [h_tile, ci(i // 2), h_row, phys])
                with mgu.when(arith.cmpi(arith.CmpIPredicate.eq, lane, ci(0))):
                    memref.store(arith.mulf(p2, mgu.c(LOG2E, f32)), c2_ref, [head])
        _asm(void, [], "fence.proxy.async.shared::cta;", "")  # generic-proxy writes, read by wgmma
        gpu.barrier()

    return fn


def _last_merge_fn(R: int, ns: int, nw: int, H: int):
    """After this CTA's partial is in gmem (o_part `[ns, 16, R]`, lse_part `[ns, 16]` f32, this sequence's
    rows): every thread fences its writes (gpu scope), thread 0 counts this split done on the sequence's counter
    (gmem `[1]` u32, zero before the kernel; acq_rel atomic add) and tells the CTA through flag smem `[1]` i32;
    the CTA that saw ns − 1 — the last of the sequence's splits — merges all ns partials exactly as
    `reference.merge_partials` into o gmem `[H, R]` (· layer scale) and lse gmem `[H]`; each of the nw · 128
    threads owns R / (nw · 128) adjacent dims of every head."""
    nthreads = 128 * nw
    dpt = R // nthreads
    if dpt < 1 or R % nthreads:
        raise ValueError(f"merge='last': {nw} warpgroups ({nthreads} threads) must divide R = {R}")

    def fn(ctx, o_part_ref, lse_part_ref, cnt_ref, flag_ref, o_ref, lse_ref, ls_ref, *wg):
        del ctx
        from jax._src.lib.mlir.dialects import gpu
        ir, arith, _, memref, vector, _, mgu = _mlir()
        f32, i32 = ir.F32Type.get(), ir.IntegerType.get_signless(32)
        index = ir.IndexType.get()
        void = ir.Type.parse("!llvm.void")
        tid = _thread_in_cta(wg)
        _asm(void, [], "fence.acq_rel.gpu;", "")  # this thread's partial writes, before the count
        gpu.barrier()
        with mgu.when(arith.cmpi(arith.CmpIPredicate.eq, tid, mgu.c(0, index))):
            old = _asm(i32, [mgu.memref_ptr(cnt_ref), mgu.c(1, i32)], "atom.acq_rel.gpu.global.add.u32 $0, [$1], $2;",
                       "=r,l,r")
            memref.store(old, flag_ref, [mgu.c(0, index)])
        gpu.barrier()
        last = arith.cmpi(arith.CmpIPredicate.eq, memref.load(flag_ref, [mgu.c(0, index)]), mgu.c(ns - 1, i32))
        with mgu.when(last):
            _asm(void, [], "fence.acq_rel.gpu;", "")  # every other split's partial, after its count
            vty = ir.VectorType.get((dpt,), f32)
            dim = arith.muli(tid, mgu.c(dpt, index))
            ls = memref.load(ls_ref, [mgu.c(0, index)])
            # every load first (one L2 round trip for all heads, not one per head), then the arithmetic
            heads = [mgu.c(h, index) for h in range(H)]
            lse_all = [[memref.load(lse_part_ref, [mgu.c(sp, index), hd]) for sp in range(ns)] for hd in heads]
            o_all = [[vector.load(vty, o_part_ref, [mgu.c(sp, index), hd, dim]) for sp in range(ns)] for hd in heads]
            lse_out = []
            for hd, lses, parts in zip(heads, lse_all, o_all):
                coefs, lse = _merge_coefs(lses, ls)
                terms = [arith.mulf(part, vector.broadcast(vty, coef)) for part, coef in zip(parts, coefs)]
                vector.store(functools.reduce(arith.addf, terms), o_ref, [hd, dim])
                lse_out.append(lse)
            with mgu.when(arith.cmpi(arith.CmpIPredicate.eq, tid, mgu.c(0, index))):
                for hd, lse in zip(heads, lse_out):
                    memref.store(lse, lse_ref, [hd])

    return fn
