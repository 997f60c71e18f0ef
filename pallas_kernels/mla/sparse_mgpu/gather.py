"""The gather side of the Mosaic GPU sparse MLA kernel: inline bodies that translate top-k slots to pool rows
through the block table, issue each block's row copies into a shared-memory stage (bulk copies or LSU `cp.async`),
and wait for stages on their mbarriers; plus the optional per-phase timer stamps (`trace=True`).
"""

from __future__ import annotations

from .config import KEYS


def _mlir():
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm, memref, vector
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mgu

    return ir, arith, llvm, memref, vector, fa, mgu


def _thread_in_wg():
    ir, arith, _, _, _, _, mgu = _mlir()
    i32 = ir.IntegerType.get_signless(32)
    return arith.remui(mgu.thread_idx(), mgu.c(128, i32))


def _thread_in_cta(wg):
    """The thread's index in the CTA (an index value): 128 · warpgroup + its index in the warpgroup; `wg` is the
    inline function's optional warpgroup argument (empty with one warpgroup)."""
    ir, arith, _, _, _, _, mgu = _mlir()
    tid = _thread_in_wg()
    if wg:
        tid = arith.addi(tid, arith.muli(_scalar(wg[0]), mgu.c(128, ir.IntegerType.get_signless(32))))
    return arith.index_cast(ir.IndexType.get(), tid)


def _kappa(g):
    """KAPPA on an index value in [0, 8)."""
    ir, arith, _, _, _, _, mgu = _mlir()
    index = ir.IndexType.get()
    bit = lambda k: arith.andi(arith.shrui(g, mgu.c(k, index)), mgu.c(1, index))  # noqa: E731
    g0, g1, g2 = bit(0), bit(1), bit(2)
    return arith.ori(arith.ori(g1, arith.shli(arith.xori(g0, g2), mgu.c(1, index))), arith.shli(g2, mgu.c(2, index)))


def _key_of(pos):
    """Fragment position (an index value) -> key: 8·(pos // 8) + KAPPA[pos % 8]."""
    ir, arith, _, _, _, _, mgu = _mlir()
    index = ir.IndexType.get()
    g = arith.remui(pos, mgu.c(8, index))
    return arith.addi(arith.subi(pos, g), _kappa(g))


def _translate_fn(blocks: int, nw: int, page: int, nblocks: int, max_blocks: int):
    """This warpgroup's slot positions (smem `[n_blk, 64]` i32, −1 = empty; its blocks are rows wg + nw·i for
    i < `blocks`) -> pool rows in place, through the sequence's block-table row (gmem `[max_blocks]` i32):
    `pool_rows`' rule (table index clamped to the row, block ids into [0, nblocks)); then a warpgroup barrier."""
    def fn(ctx, idx_ref, bt_ref, wg=None):  # wg: a scalar argument, or None (one warpgroup: 0)
        del ctx
        ir, arith, _, memref, _, _, mgu = _mlir()
        i32 = ir.IntegerType.get_signless(32)
        index = ir.IndexType.get()
        wg = mgu.c(0, index) if wg is None else arith.index_cast(index, _scalar(wg))
        tid = arith.index_cast(index, _thread_in_wg())
        half, lane = arith.divui(tid, mgu.c(KEYS, index)), arith.remui(tid, mgu.c(KEYS, index))
        for i0 in range(0, blocks, 2):  # 128 threads: two blocks of 64 slots per pass
            i = arith.addi(half, mgu.c(i0, index))
            with mgu.when(arith.cmpi(arith.CmpIPredicate.ult, i, mgu.c(blocks, index))):
                at = [arith.addi(wg, arith.muli(i, mgu.c(nw, index))), lane]
                pos = memref.load(idx_ref, at)
                safe = arith.maxsi(pos, mgu.c(0, i32))
                col = arith.minsi(arith.divsi(safe, mgu.c(page, i32)), mgu.c(max_blocks - 1, i32))
                blk = memref.load(bt_ref, [arith.index_cast(index, col)])
                blk = arith.minsi(arith.maxsi(blk, mgu.c(0, i32)), mgu.c(nblocks - 1, i32))
                row = arith.addi(arith.muli(blk, mgu.c(page, i32)), arith.remsi(safe, mgu.c(page, i32)))
                empty = arith.cmpi(arith.CmpIPredicate.slt, pos, mgu.c(0, i32))
                memref.store(arith.select(empty, mgu.c(-1, i32), row), idx_ref, at)
        mgu.warpgroup_barrier()

    return fn


def _scalar(x):
    """An inline_mgpu scalar argument (a splat array of one register, or an ir.Value) -> its ir.Value."""
    ir, _, _, _, vector, _, _ = _mlir()
    if not isinstance(x, ir.Value):
        x = x.registers.flat[0]
    if isinstance(x.type, ir.VectorType):
        x = vector.extract(x, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([0]))
    return x


def _asm(ret, args, ptx, constraints):
    _, _, llvm, _, _, _, _ = _mlir()
    return llvm.inline_asm(ret, list(args), ptx, constraints, has_side_effects=True)


def _init_barriers_fn(stages: int):
    """mbarriers (8 bytes each, in an int32 scratch) initialised by thread 0 with one arrival, made visible."""
    def fn(ctx, bar_ref):
        del ctx
        ir, arith, llvm, _, _, _, mgu = _mlir()
        i8, i32 = ir.IntegerType.get_signless(8), ir.IntegerType.get_signless(32)
        base = mgu.memref_ptr(bar_ref)
        void = ir.Type.parse("!llvm.void")
        with mgu.when(arith.cmpi(arith.CmpIPredicate.eq, _thread_in_wg(), mgu.c(0, i32))):
            for s in range(stages):
                _asm(void, [mgu.getelementptr(base, [8 * s], i8)], "mbarrier.init.shared::cta.b64 [$0], 1;", "l")
            _asm(void, [], "fence.mbarrier_init.release.cluster;", "")
            _asm(void, [], "fence.proxy.async.shared::cta;", "")
        mgu.warpgroup_barrier()
        del llvm

    return fn


def _copy_types():
    """(i8, i32, i64, index, void) MLIR types of the gather builders."""
    ir = _mlir()[0]
    i8, i32, i64 = (ir.IntegerType.get_signless(n) for n in (8, 32, 64))
    return i8, i32, i64, ir.IndexType.get(), ir.Type.parse("!llvm.void")


def _issue_fn(row_bytes: int, stride: int):
    """Gather one block: a warpgroup barrier (every thread is done with the stage's previous block), thread 0 expects
    64 rows' bytes on the stage's mbarrier, threads 0..63 each copy one pool row (`cp.async.bulk`; empty slots, −1,
    copy row 0 and are masked in the softmax)."""
    def fn(ctx, pool_ref, dst_ref, idx_ref, bar_ref):
        del ctx
        _, arith, llvm, memref, _, _, mgu = _mlir()
        i8, i32, i64, index, void = _copy_types()
        mgu.warpgroup_barrier()
        tid = _thread_in_wg()
        bar = mgu.memref_ptr(bar_ref)
        with mgu.when(arith.cmpi(arith.CmpIPredicate.eq, tid, mgu.c(0, i32))):
            _asm(void, [bar, mgu.c(KEYS * row_bytes, i32)],
                 "mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;", "l,r")
        with mgu.when(arith.cmpi(arith.CmpIPredicate.ult, tid, mgu.c(KEYS, i32))):
            row = memref.load(idx_ref, [arith.index_cast(index, tid)])
            row = arith.maxsi(row, mgu.c(0, i32))
            src = mgu.getelementptr(mgu.memref_ptr(pool_ref), [arith.muli(arith.extui(i64, row),
                                                                          mgu.c(row_bytes, i64))], i8)
            dst = mgu.getelementptr(mgu.memref_ptr(dst_ref), [arith.muli(tid, mgu.c(stride, i32))], i8)
            _asm(void, [dst, src, mgu.c(row_bytes, i32), bar],
                 "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], $2, [$3];",
                 "l,l,r,l")
        del llvm

    return fn


def _issue_lsu_fn(row_bytes: int, stride: int):
    """`_issue_fn`'s contract with the load/store units instead of the TMA: the warpgroup's 128 threads copy the
    block's 64 rows as 16-byte `cp.async` chunks (chunk j of the block: row j // (row_bytes / 16), so a warp's 32
    chunks are 512 contiguous bytes of one or two rows), each thread's copies tracked on the stage's mbarrier by
    `cp.async.mbarrier.arrive` (which raises the pending count itself); after a warpgroup barrier thread 0 gives
    the barrier's one expected arrival."""
    def fn(ctx, pool_ref, dst_ref, idx_ref, bar_ref):
        del ctx
        _, arith, _, memref, _, _, mgu = _mlir()
        i8, i32, i64, index, void = _copy_types()
        per_row = row_bytes // 16
        mgu.warpgroup_barrier()
        tid = _thread_in_wg()
        pool, dst0, bar = mgu.memref_ptr(pool_ref), mgu.memref_ptr(dst_ref), mgu.memref_ptr(bar_ref)
        for i in range(-(-KEYS * per_row // 128)):
            j = arith.addi(tid, mgu.c(128 * i, i32))
            with mgu.when(arith.cmpi(arith.CmpIPredicate.ult, j, mgu.c(KEYS * per_row, i32))):
                r, col = arith.divui(j, mgu.c(per_row, i32)), arith.remui(j, mgu.c(per_row, i32))
                row = arith.maxsi(memref.load(idx_ref, [arith.index_cast(index, r)]), mgu.c(0, i32))
                src_off = arith.addi(arith.muli(arith.extui(i64, row), mgu.c(row_bytes, i64)),
                                     arith.extui(i64, arith.muli(col, mgu.c(16, i32))))
                dst_off = arith.addi(arith.muli(r, mgu.c(stride, i32)), arith.muli(col, mgu.c(16, i32)))
                _asm(void, [mgu.getelementptr(dst0, [dst_off], i8), mgu.getelementptr(pool, [src_off], i8)],
                        "cp.async.cg.shared.global [$0], [$1], 16;", "l,l")
        _asm(void, [bar], "cp.async.mbarrier.arrive.shared::cta.b64 [$0];", "l")
        _arrive_once(bar)

    return fn


def _arrive_once(bar):
    """A warpgroup barrier (every thread's work before it is done), then thread 0 arrives once on the mbarrier at
    the shared-memory pointer `bar`."""
    _, arith, _, _, _, _, mgu = _mlir()
    _, i32, _, _, void = _copy_types()
    mgu.warpgroup_barrier()
    with mgu.when(arith.cmpi(arith.CmpIPredicate.eq, _thread_in_wg(), mgu.c(0, i32))):
        _asm(void, [bar], "mbarrier.arrive.shared::cta.b64 _, [$0];", "l")


def issue_fn(gather: str):
    """The block gather's builder for `MgpuSparseConfig.gather`: "tma" (`_issue_fn`) or "lsu" (`_issue_lsu_fn`)."""
    return {"tma": _issue_fn, "lsu": _issue_lsu_fn}[gather]


def _wait_fn():
    """Every thread waits for the stage's mbarrier to complete the phase of the given parity."""
    def fn(ctx, bar_ref, parity):
        del ctx
        ir, arith, _, _, _, _, mgu = _mlir()
        i1, i32 = ir.IntegerType.get_signless(1), ir.IntegerType.get_signless(32)
        parity = _scalar(parity)
        bit = arith.trunci(i1, arith.andi(parity, mgu.c(1, i32)))
        mgu.BarrierRef(mgu.memref_ptr(bar_ref), mgu.c(0, i32), None, 1).wait_parity(bit)

    return fn


def _stamp_fn():
    """Thread 0 of the warpgroup stores the low 32 bits of the GPU's global nanosecond timer (`%globaltimer_lo`) at
    the given position of its trace row (gmem `[T]` int32): `kernel_call(trace=True)`'s timeline of one CTA."""
    def fn(ctx, trace_ref, pos):
        del ctx
        ir, arith, _, memref, _, _, mgu = _mlir()
        i32, index = ir.IntegerType.get_signless(32), ir.IndexType.get()
        now = _asm(i32, [], "mov.u32 $0, %globaltimer_lo;", "=r")
        with mgu.when(arith.cmpi(arith.CmpIPredicate.eq, _thread_in_wg(), mgu.c(0, i32))):
            memref.store(now, trace_ref, [arith.index_cast(index, _scalar(pos))])

    return fn
