"""Sparse MLA decode on Hopper in Pallas Mosaic GPU: fp8 latent rows, wgmma, one gathered load feeding both dots.

Why a second GPU kernel: the Pallas Triton kernel (`sparse_gpu.py`) is issue- and occupancy-bound at 0.24 of copy
bandwidth (B = 32, H = 12): Triton feeds `mma.sync` with 16-row tiles, loads every gathered row twice and converts
it twice (bench/RESULTS.md, sessions 7–9). Here one CTA (one warpgroup) takes one sequence and one of `splits`
slices of its top-k slots. It maps its slot positions to pool rows through the block table once (`pool_rows`'
rule), then walks them in blocks of 64 keys:

1. gather: threads 0..63 each issue one bulk copy (`cp.async.bulk`, no tensor map) of a whole stored row (576 fp8
   bytes at K3) into a shared-memory stage (row stride c + 32), all completing on one mbarrier; `stages` blocks are
   in flight.
2. logits: Sᵀ `[64 keys, 16 heads]` = rows · qᵀ on wgmma with the KEYS as the M side — the fp8 bytes are converted
   (`cvt.rn.f16x2.e4m3x2`) straight into the A-operand registers, q (f16, heads padded to 16) is the B operand.
3. softmax over the block's keys (per head; a cross-warp max through shared memory), fp32, in the log2 domain.
4. PV: outᵀ `[R dims, 16 heads]` += Vᵀ · Pᵀ with the latent DIMS as the M side (8 tiles of 64 at R = 512): the same
   shared-memory bytes, converted into the A registers a second way; Pᵀ (f16) is the B operand.

Operand orders (wgmma only needs A and B to agree on the contraction order; the M order is ours):
- logits: thread t of a quad loads the 16 contiguous bytes [64j + 16t, +16) of its key row; word s becomes k-step s
  of the 64-column chunk j (the `x_permutation` order of `moe.mgpu_mxfp4`, which q is permuted by in XLA).
- PV: thread (warp w, group g) owns the 2T contiguous dims [2T(8w + g), +2T) of every key row (T = R / 64 tiles):
  one load per key row, then `prmt` pairs the bytes of two keys for each dim; output row 64i + 16w + 8h + g of tile
  i holds dim 2T(8w + g) + 2i + h (`value_dim_of_row`); the epilogue writes o in natural order.
- keys: fragment position p (a logits row, a PV column) holds key 8·(p // 8) + KAPPA[p % 8]. With the row stride
  c + 32 this makes every 16-byte shared-memory load of both operands conflict-free (in plain order the PV loads
  took 16 wavefronts instead of 4; ncu, session 12).

Precision is the storage formats' (`precision="storage"`): q in f16 after a per-head power-of-two normalisation
(the same bits as `sparse_gpu._prep_q`), P in f16, fp32 accumulation and softmax (ex2 / lg2 approximations).
Partial (o, lse) per split are merged exactly by `sparse_gpu`'s Pallas merge kernel (or in the kernel, `merge`).

Measured (H200, session 12, `bench/mla_mgpu.py`, B = 32, H = 12, ctx 32K, fp8, bench/RESULTS.md): correct on the
device from the first run (`tests/test_sparse_mgpu.py -m gpu`); the kernel alone 30.1–30.2 µs (0.29–0.30 of copy;
the Triton kernel ≈ 30–31.6), the whole op **38.7 µs (0.231 of copy) vs 42.3 for the Triton storage preset** (1.09×;
bar 0.60 ≈ 15 µs). ncu: 255 registers and ≈ 98 KB of shared memory hold an SM to 2 CTAs (8 warps); each warp issues
once per ≈ 8 cycles — waiting on the gathers (long scoreboard), on fixed-latency chains (LDS -> prmt -> cvt ->
wgmma) and on the block's barriers; removing the PV loads' 4-way bank conflicts (v2) and independent logits
accumulators (`logits_accs`, slower) did not move it. Knobs timed (kernel alone, µs; one warpgroup and 8 splits,
then the default): 30.1, value_keys 64 30.2–31.6 / 16 31.7, splits 4 + stages 3/4 33.5–35.0, splits 16 36.0–41.4,
stages 3 37.8, logits_chunk 576 45.1.
Session 13: `warpgroups` 2 / 4 correct on the device; **2 warpgroups × 4 splits (now the default) 26.5–29.9 µs**
alone, whole op 35.9–39.7 µs (0.23–0.25 of copy) vs the Triton preset's 39.6–43.3 in the same runs; 4 warpgroups
(128 registers) 34.9. Merging the splits in the kernel did not pay: `merge="last"` (the sequence's last CTA, an
atomic counter) op 36.5 vs 35.9; a cluster merge through distributed shared memory (commit 43303f4, since removed)
53.0 — 4-CTA clusters at one CTA per SM do not all fit at once.

Written in session 13, first run on the H200 in session 14 (all correct the first time, `bench/runs/s14_gpu1.sh`):
`prep="kernel"` — each CTA prepares q itself from the raw row (`_prep_q_fn`: the same bits as `prepare_q`, written
into q's tiled, 128-byte-swizzled shared-memory layout by hand), so `prep="kernel", merge="last"` is the whole op in
one launch: **op 33.8 µs vs 43.2** for the two-launch op with q prepared in XLA (Triton preset 42.1, copy 4.23 TB/s;
0.26 of copy against the 0.60 bar), now the default. `logits_mma="fp8"` — the logits on e4m3 tensor cores straight
from the stored bytes (no conversion), q as two e4m3 planes (CPU contract emulation error 7.8e-4 vs 2.9e-4 with
f16 q; bar 5e-3) — and `value_mma="fp8"` — the PV product on e4m3 tensor cores: 4×4 byte transposes
(`_TRANSPOSE4`, 8 `prmt` per 16 bytes) instead of `prmt` + `cvt` per 2 bytes, P · 2^8 as two e4m3 planes stored
transposed by hand into the swizzled B layout (`_store_p_fp8_fn`), positions `pv_key_of` — remove ≈ 270 of ≈ 1,070
instructions per warp and block but barely move the kernel (25.3 / 25.5 µs vs 26.3 alone): it is not issue-bound.
As whole ops they lose (50.8 µs: the q planes are XLA work); opt-in. After session 14's device time (lowers on CPU,
NOT yet run on a GPU): the slots load on their own barrier, so a CTA translates and issues its first gathers without
waiting for q's 27 KB.

Session 28: `mma_wait="chunk"` (now the default) waits for each chunk's wgmmas, so one chunk's A fragment is live
at a time instead of all 36 logits fragments (144 registers, converted before the first wgmma in the SASS): 220
registers, no spills, **op 29.1 µs vs 33.4 (0.31 of copy)**. `kernel_call(trace=True)` stamps each warpgroup's
phases (`trace_phases`, `bench/mla_mgpu.py --ops trace`): a CTA takes ≈ 19.5 µs at B = 32 and at B = 1 alike —
≈ 5 µs of prologue (slots, translation, q), 4 blocks × 2.1 µs of serial compute, ≈ 2.3 µs waiting for refills,
≈ 3.5 µs of epilogue — so the 0.60 bar needs a different structure (bench/RESULTS.md, session 28).
Session 29: the bar is above what any gather measured reaches at all — the kernel's LSU gather alone 0.586 of copy,
a plain read-only Triton gather 0.52. `producer=True` (opt-in) adds a producer warpgroup that keeps every stage
full: no refill waits, CTA 18.6 µs, kernel span 21.0 µs (0.43 of copy), but the op ties the default (31.0 vs
30.4 µs). Its first run computed 1.7× slower: in the consumers' branch LLVM could not prove the rows' 16-byte loads
aligned and split them into byte loads; `_row_load` now states the alignment.

Opt-in: `sparse.sparse_mla(..., backend="gpu", kernel_kw={"impl": "mgpu", **MgpuSparseConfig fields})`. GPU only:
the body lowers on CPU (tests), runs on an H200.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from ..moe.mgpu_mxfp4 import _fragment_slots, ws_compute_registers, x_permutation
from ..moe.mxfp4 import split_e4m3_planes
from ..triton_prims import CVT_E4M3X4_F16_PTX
from .sparse_gpu import _merge_pallas, _pow2_at_least

KEYS = 64  # keys per block: the M side of the logits wgmma
HEADS = 16  # heads per CTA (the N side), zero-padded
CHUNK = 64  # latent columns per 16-byte load of a thread quad (4 threads x 16 bytes)
# key order inside each group of 8 (fragment row / column position g -> key 8·(g // 8) + KAPPA[g % 8]) and the
# shared-memory row stride c + 32: with both, every 16-byte load of either operand is free of bank conflicts (found by
# search; the plain order and stride c gave the PV loads 4-way conflicts: 16 wavefronts per load, ncu, session 12)
KAPPA = (0, 2, 1, 3, 6, 4, 7, 5)  # bits: k0 = g1, k1 = g0 ^ g2, k2 = g2
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@dataclasses.dataclass(frozen=True)
class MgpuSparseConfig:
    """Defaults: the fastest measured at B = 32, H = 12, 32K: 2 warpgroups × 4 splits (session 13: kernel
    26.5–29.9 µs vs 30.0 for one warpgroup and 8 splits), the whole op in one launch (session 14: 33.8 µs vs 43.2
    with q prepared in XLA and a merge launch, Triton 42.1), wgmmas waited for chunk by chunk (session 28: op 29.1 µs
    vs 33.4)."""
    splits: int = 4  # CTAs per sequence, each over k / splits slots (a multiple of 64)
    stages: int = 2  # gathered blocks in flight per warpgroup (64 rows · (c + 32) B: 38 KB each at K3)
    logits_chunk: int = 192  # latent columns converted per logits wgmma call (a multiple of 64 dividing c)
    value_keys: int = 32  # keys converted per PV wgmma call (16, 32 or 64)
    # independent logits accumulators (the chunks dealt round-robin, summed after): one accumulator makes the
    # block's c/16 wgmmas one dependent chain on the tensor core (36 at K3)
    logits_accs: int = 1
    # warpgroups per CTA, each walking every warpgroups-th block of the CTA's split with its own stages, softmax and
    # accumulator, combined in shared memory at the end (`_combine_fn`). 2: 255 registers, ≈ 184 KB, one CTA of 8
    # warps per SM, 128 CTAs at B = 32 (one wave); 4 caps ptxas at 128 registers (16 warps per SM) but was slower
    # (34.9 µs with one stage)
    warpgroups: int = 2
    # how the splits' partials meet: "kernel" — written to gmem and merged by `sparse_gpu`'s Pallas merge kernel (a
    # second launch); "last" — the same partials, merged in this kernel by the sequence's last CTA to finish (a
    # global atomic counter per sequence, `_last_merge_fn`; the partials come back from L2), which writes the final
    # o `[B, H, R]` itself: one launch fewer (session 13: op 36.5 vs 35.9 µs alone; with prep="kernel" 33.8 vs 43.2)
    merge: str = "last"
    # where q is prepared (scaled, normalised per head by a power of two, permuted into the contraction order, f16):
    # "xla" — `prepare_q`, a separate XLA op; "kernel" — each CTA from the raw q row of its sequence (`_prep_q_fn`,
    # the same bits), so with merge="last" the whole op is one launch
    prep: str = "kernel"
    # the logits' tensor-core type: "f16" — each stored e4m3 byte converted into the A registers (`cvt`), q in f16;
    # "fp8" — the stored bytes ARE the A registers (no conversion), q as two e4m3 planes (hi + lo ≈ 8 significant
    # bits, `moe.mxfp4.split_e4m3_planes`), two e4m3 wgmmas per 32 columns (`prepare_q_fp8`; prep="xla" only).
    # Session 14: kernel 25.3 vs 26.3 µs, but the op (q planes in XLA) 50.8 vs 43.2 with prep="xla"
    logits_mma: str = "f16"
    # the PV product's tensor-core type: "f16" — key pairs `prmt`ed and converted into f16 A registers, P in f16;
    # "fp8" — 4×4 byte transposes (8 `prmt` per 16 bytes, no conversion) make e4m3 A registers of 4 keys per dim,
    # P · 2^8 as two e4m3 planes in shared memory (`_store_p_fp8_fn`), two wgmmas per 32 keys (value_keys ignored).
    # Session 14, with fp8 logits: kernel 25.5 µs (no gain over fp8 logits alone)
    value_mma: str = "f16"
    # how a block's 64 rows reach shared memory: "tma" — one `cp.async.bulk` per 576-byte row by threads 0..63;
    # "lsu" — all 128 threads copy 16-byte `cp.async` chunks (coalesced 512 B per warp). Gather alone (no maths,
    # bench/mla_gather_probe.py, session 15, B = 32): tma 17.7 / 25.7 µs in two calls, lsu 15.2 (0.59 of copy)
    gather: str = "tma"
    # when a warpgroup waits for its wgmmas: "block" — once after the block's logits and once after its PV product,
    # so every chunk's A operand stays live until then (the SASS, session 28: all 36 logits A fragments, 144
    # registers, converted before the first wgmma; 255 registers and spills); "chunk" — after each logits chunk and
    # each PV call, so one chunk's A is live at a time: 220 registers, no spills, the op 29.1 µs vs 33.4 (session 28)
    mma_wait: str = "chunk"
    # who gathers the rows: False — each warpgroup issues its own blocks (its first `stages` up front, each refill
    # when it is done with a stage); True — one more warpgroup, the producer, issues every block's gather (with
    # `gather`'s copies) into the warpgroups' stages as soon as a stage is released, at 40 registers
    # (`setmaxnreg`), while the consumers, at `moe.mgpu_mxfp4.ws_compute_registers`, only compute (at most 2 of
    # them). H200, session 29, B = 32: with the TMA copies the refill waits vanish (CTA 18.6 µs against 19.5) but
    # the op ties the default (31.0 vs 30.4 µs); with the LSU copies (the fastest gather alone, 0.59 of copy) it is
    # slower (40.0 µs): one warpgroup's 2,304 16-byte copies per block compete with the consumers' shared loads
    producer: bool = False

    def __post_init__(self):
        if self.gather not in ("tma", "lsu"):
            raise ValueError(f"gather must be 'tma' or 'lsu', not {self.gather!r}")
        if self.mma_wait not in ("block", "chunk"):
            raise ValueError(f"mma_wait must be 'block' or 'chunk', not {self.mma_wait!r}")
        if self.producer and self.warpgroups > 2:
            raise ValueError(f"a producer warpgroup leaves {self.warpgroups} compute warpgroups too few registers "
                             "(at most 2)")


def supports(fmt, config: MgpuSparseConfig | None = None) -> bool:
    """fp8 rows whose latent width R is 128, 256 or 512 and whose row width c = R + rope is 64 more than a multiple
    of 128 (K3: 576; the conflict-free shared-memory stride `row_stride` assumes it); with a `config`, also that
    config's shape rules (merge="last" needs the CTA's 128 · warpgroups threads to divide R)."""
    R, rope = getattr(fmt, "latent", 0), getattr(fmt, "rope", 0)
    ok = getattr(fmt, "kv_dtype", None) == "fp8" and R in (128, 256, 512) and (R + rope) % 128 == 64
    if ok and config is not None and config.merge == "last":
        ok = R % (128 * config.warpgroups) == 0
    return ok


def row_stride(c: int) -> int:
    """Bytes between gathered rows in shared memory (c + 32, see KAPPA)."""
    return c + 32


def value_dim_of_row(R: int) -> np.ndarray:
    """dims `[R]`: row r of the kernel's outᵀ holds latent dim dims[r] (module docstring, PV order)."""
    T = R // 64
    r = np.arange(R)
    i, w, h, g = r // 64, (r % 64) // 16, (r % 16) // 8, r % 8
    return (2 * T * (8 * w + g) + 2 * i + h).astype(np.int32)


def prepare_q(q_bhc, qscale):
    """q `[B, H, c]` (any float) and the logit scale (scale · layer scale) -> (q `[B, 16, c]` f16 in the kernel's
    contraction order, heads zero-padded; c2 `[B, 16]` f32: each head's power of two times log2 e, which turns the
    f16 dot back into log2-domain logits). The power of two is `sparse_gpu._pow2_at_least` of the head's max |q|."""
    B, H, c = q_bhc.shape
    if H > HEADS:
        raise ValueError(f"the mgpu sparse MLA kernel takes ≤ {HEADS} heads per call, got {H}")
    q = q_bhc.astype(jnp.float32) * qscale
    s = _pow2_at_least(jnp.max(jnp.abs(q), axis=-1))  # [B, H]
    q = (q / s[..., None])[..., jnp.asarray(x_permutation(c))]
    q = jnp.pad(q, ((0, 0), (0, HEADS - H), (0, 0))).astype(jnp.float16)
    c2 = jnp.pad(s * LOG2E, ((0, 0), (0, HEADS - H)), constant_values=LOG2E)
    return q, c2


def fp8_q_permutation(c: int) -> np.ndarray:
    """perm `[c]` for the fp8 logits: contraction column L reads stored column perm[L]. Thread t of a quad loads the
    16 bytes [64j + 16t, +16) of its key row; its word s is the WGMMA_8BIT register of 32-column group 2j + s // 2,
    block s % 2 (columns 16·(s % 2) + 4t .. + 3 of that group)."""
    L = np.arange(c)
    j, r = L // 64, L % 64
    s = 2 * (r // 32) + (r % 32) // 16
    return (64 * j + 16 * ((r % 16) // 4) + 4 * s + r % 4).astype(np.int32)


def prepare_q_fp8(q_bhc, qscale):
    """`prepare_q` for logits_mma="fp8": q `[B, H, c]` and the logit scale -> (q_hi, q_lo `[B, 16, c]` e4m3 in
    `fp8_q_permutation` order, heads zero-padded; c2 `[B, 16]` f32 = each head's 1/c (`split_e4m3_planes`) ·
    log2 e)."""
    B, H, c = q_bhc.shape
    if H > HEADS:
        raise ValueError(f"the mgpu sparse MLA kernel takes ≤ {HEADS} heads per call, got {H}")
    q = q_bhc.astype(jnp.float32)[..., jnp.asarray(fp8_q_permutation(c))] * qscale
    q = jnp.pad(q, ((0, 0), (0, HEADS - H), (0, 0)))
    hi, lo, inv = split_e4m3_planes(q.reshape(B * HEADS, c))
    return hi.reshape(B, HEADS, c), lo.reshape(B, HEADS, c), inv.reshape(B, HEADS) * LOG2E


def q_column_of(i: int, lane):
    """In-kernel q preparation: lane `lane` of a warp reads q's physical column 32·i + lane and writes it to this
    column of the kernel's contraction order (the inverse of `x_permutation`): 64·(i // 2) + 4·(i % 2) plus a
    lane-only part. Works on ints and numpy arrays (tests); `_prep_q_fn` builds the same sum in MLIR."""
    return 64 * (i // 2) + 4 * (i % 2) + _q_lane_part(lane)


def _q_lane_part(lane):
    """The lane-only part of `q_column_of`: with quad q = lane // 16, s = (lane // 4) % 4, t = lane % 4 of the
    physical column 16q + 4s + t of a 64-column block, the logical column is 16s + 2q + (t & 1) + 8 (t >> 1)."""
    return 16 * ((lane // 4) % 4) + 2 * (lane // 16) + (lane % 2) + 8 * ((lane % 4) // 2)


def prepare_slots(idx_bk, splits: int, multiple: int = 1):
    """Top-k positions `[B, k]` -> `[B, splits, n_blk, 64]` int32 (−1 = empty), k padded with empty slots to
    splits · n_blk · 64 (n_blk a multiple of `multiple`: the kernel's warpgroups). The kernel maps them to pool rows
    through the block table itself (`pool_rows`' rule)."""
    B, k = idx_bk.shape
    n_blk = -(-k // (splits * KEYS))
    n_blk = -(-n_blk // multiple) * multiple
    idx = jnp.pad(jnp.asarray(idx_bk, jnp.int32), ((0, 0), (0, splits * n_blk * KEYS - k)), constant_values=-1)
    return idx.reshape(B, splits, n_blk, KEYS)


# ---------------------------------------------------------------------------------------------------------------------
# Inline Mosaic GPU pieces (MLIR built at lowering time; imported lazily so CPU-only installs never need them)


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


P_SCALE = 256.0  # fp8 PV: P · 2^8 in the e4m3 planes (probabilities down to 2^-17 survive), o · 2^-8 at the end


def pv_key_of(p):
    """fp8 PV: contraction position p (0..63) -> key: inside each 16, (4a + b) -> 4b + a (an involution). Thread q
    of a quad then loads keys 4e + q for its 4 positions 4q + e: the 8 lanes of a load phase hit 8 bank groups."""
    return (p // 16) * 16 + 4 * (p % 4) + (p % 16) // 4


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


def _release_fn():
    """A consumer warpgroup is done with a stage: a warpgroup barrier (every thread's reads of it are done), then
    thread 0 arrives on the stage's `empty` mbarrier (one expected arrival), which the producer waits on before it
    gathers the next block into the stage."""
    def fn(ctx, bar_ref):
        del ctx
        *_, mgu = _mlir()
        _arrive_once(mgu.memref_ptr(bar_ref))

    return fn


PRODUCER_REGISTERS = 40  # registers per thread of the producer warpgroup (it only issues copies)
CONSUMERS_BARRIER = 15  # the named barrier the consumer warpgroups meet at (0: the CTA's; 1-4: each warpgroup's)


def _consumers_barrier(nw: int, producer: bool):
    """A barrier of the CTA's nw compute warpgroups: the CTA barrier, or with a producer warpgroup (which never
    meets them) the named barrier CONSUMERS_BARRIER over their 128·nw threads."""
    if not producer:
        from jax._src.lib.mlir.dialects import gpu
        gpu.barrier()
    else:
        _asm(_copy_types()[4], [], f"bar.sync {CONSUMERS_BARRIER}, {128 * nw};", "")


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


def trace_ns(trace) -> np.ndarray:
    """`kernel_call(trace=True)`'s stamps `[..., T]` int32 (the timer's low 32 bits) -> int64 ns with each row's
    32-bit wrap undone (a row spans microseconds; the timer wraps every 4.3 s)."""
    t = np.asarray(trace, np.int64)
    return (t - t[..., :1]) % (1 << 32) + t[..., :1]


def trace_phases(trace, blocks_per_wg: int) -> dict:
    """`kernel_call(trace=True)`'s stamps `[NS, B, NW, T]` int32 (ns, low 32 bits) -> each phase's duration in µs
    over every CTA warpgroup (median, max) and the kernel's span: "launch skew" (this CTA's start after the first
    CTA's), "slots + translate", "q ready / prepared", per block "wait gather" and "compute", "finish + combine",
    "last merge". Positions: 0 start, 1 slots translated, 2 q ready, 3 + 2i gather i arrived, 4 + 2i block i
    computed, 3 + 2n finished (combined), 4 + 2n merged."""
    t = trace_ns(trace)
    t0 = t[..., 0]
    us = lambda a: np.asarray(a, np.float64) / 1e3  # noqa: E731
    phases = {"launch skew": us(t0 - t0.min()), "slots + translate": us(t[..., 1] - t[..., 0]),
              "q ready / prepared": us(t[..., 2] - t[..., 1])}
    prev = t[..., 2]
    for i in range(blocks_per_wg):
        phases[f"block {i} wait gather"] = us(t[..., 3 + 2 * i] - prev)
        phases[f"block {i} compute"] = us(t[..., 4 + 2 * i] - t[..., 3 + 2 * i])
        prev = t[..., 4 + 2 * i]
    n = blocks_per_wg
    phases["finish + combine"] = us(t[..., 3 + 2 * n] - prev)
    phases["last merge"] = us(t[..., 4 + 2 * n] - t[..., 3 + 2 * n])
    phases["CTA total"] = us(t[..., 4 + 2 * n] - t[..., 0])
    phases["kernel span"] = us(np.array([t[..., 4 + 2 * n].max() - t0.min()]))
    return {k: (float(np.median(v)), float(v.max())) for k, v in phases.items()}


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
    from the address arithmetic, and where it cannot (the consumer warpgroups' branch of `producer=True`, session
    29: 7 of 16 LDS.128 per block) it splits the load into single bytes."""
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


def _q_transforms():
    """q smem's layout when the kernel writes it (prep="kernel"): tiles of 8 heads × 64 columns, 128-byte swizzle
    (the inline code must address the tiles itself; with prep="xla" TMA fills q in the layout Mosaic infers)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu
    return (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


def _q_fp8_transforms():
    """q's e4m3 planes in smem (logits_mma="fp8"): tiles of 8 heads × 32 bytes, 32-byte swizzle — one tile row is
    one wgmma's K (as for x in `moe.mgpu_mxfp4.kernel_call_fp8`)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu
    return (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(32))


def _prep_q_fn(c: int, H: int, nw: int, producer: bool = False):
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
        from jax._src.lib.mlir.dialects import math as mlir_math
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
                # `sparse_gpu._pow2_at_least`: 2^(e + 1) for m's exponent bits e, 1 where m = 0
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
        _consumers_barrier(nw, producer)

    return fn


def _last_merge_fn(R: int, ns: int, nw: int, H: int, producer: bool = False):
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
        ir, arith, _, memref, vector, _, mgu = _mlir()
        f32, i32 = ir.F32Type.get(), ir.IntegerType.get_signless(32)
        index = ir.IndexType.get()
        void = ir.Type.parse("!llvm.void")
        tid = _thread_in_cta(wg)
        _asm(void, [], "fence.acq_rel.gpu;", "")  # this thread's partial writes, before the count
        _consumers_barrier(nw, producer)
        with mgu.when(arith.cmpi(arith.CmpIPredicate.eq, tid, mgu.c(0, index))):
            old = _asm(i32, [mgu.memref_ptr(cnt_ref), mgu.c(1, i32)], "atom.acq_rel.gpu.global.add.u32 $0, [$1], $2;",
                       "=r,l,r")
            memref.store(old, flag_ref, [mgu.c(0, index)])
        _consumers_barrier(nw, producer)
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


# ---------------------------------------------------------------------------------------------------------------------


def kernel_call(q, c2, slots, block_tables, pool_u8, *, R: int, page: int,
                config: MgpuSparseConfig = MgpuSparseConfig(), H: int = HEADS, layer_scale=1.0, scale=None,
                trace: bool = False):
    """The Mosaic GPU kernel alone: q `[B, 16, c]` f16 and c2 `[B, 16]` f32 (`prepare_q`) — or, with
    `prep="kernel"`, the raw q `[B, H, c]` f32 / bf16, c2 None and the logit `scale` (the layer scale multiplies
    it) —, slots `[B, splits, n_blk, 64]` int32 positions (`prepare_slots`; n_blk a multiple of the warpgroups),
    block_tables `[B, max_blocks]` int32, pool `[num_blocks · page, c]` uint8 (fp8 bits) -> (o `[splits, B, 16, R]`
    f32 normalised per split, lse `[splits, B, 16]` f32); with `merge="last"` the merged result instead: (o
    `[B, H, R]` f32 · layer_scale, lse `[B, H]` f32) for the first H heads. `trace=True` (a diagnostic) appends
    each CTA warpgroup's timeline `[splits, B, warpgroups, 5 + 2 · blocks per warpgroup]` int32 (`_stamp_fn`,
    read with `trace_phases`)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    B, _, c = (q[0] if isinstance(q, tuple) else q).shape
    _, NS, n_blk, _ = slots.shape
    max_blocks = block_tables.shape[1]
    nblocks = pool_u8.shape[0] // page
    cfg = config
    S, LC, VK, NW, PR = cfg.stages, cfg.logits_chunk, cfg.value_keys, cfg.warpgroups, cfg.producer
    NA = max(1, min(cfg.logits_accs, c // LC))
    if c % LC or LC % CHUNK or KEYS % VK or VK % 16 or R % 128 or R > c:
        raise ValueError(f"mgpu sparse MLA: row width {c} must be a multiple of logits_chunk {LC} (a multiple of "
                         f"{CHUNK}); value_keys {VK} must divide {KEYS} (multiple of 16); R {R}")
    if NW not in (1, 2, 4) or n_blk % NW:
        raise ValueError(f"warpgroups {NW} must be 1, 2 or 4 and divide the blocks per split {n_blk}")
    if cfg.merge not in ("kernel", "last"):
        raise ValueError(f"merge must be 'kernel' or 'last', got {cfg.merge!r}")
    if cfg.prep not in ("xla", "kernel"):
        raise ValueError(f"prep must be 'xla' or 'kernel', got {cfg.prep!r}")
    last, qk = cfg.merge == "last", cfg.prep == "kernel"
    chunk_wait = cfg.mma_wait == "chunk"
    f8 = cfg.logits_mma == "fp8"
    if cfg.logits_mma not in ("f16", "fp8") or (f8 and qk):
        raise ValueError(f"logits_mma must be 'f16' or 'fp8' (fp8 with prep='xla'), got {cfg.logits_mma!r}")
    v8 = cfg.value_mma == "fp8"
    if cfg.value_mma not in ("f16", "fp8"):
        raise ValueError(f"value_mma must be 'f16' or 'fp8', got {cfg.value_mma!r}")
    if f8 != (isinstance(q, tuple)):
        raise ValueError("logits_mma='fp8' takes q as the (q_hi, q_lo) planes of `prepare_q_fp8`")
    q, q_lo = q if f8 else (q, None)  # fp8 logits: q's hi plane goes where the f16 q would, lo beside it
    if qk and (c2 is not None or scale is None or q.shape[1] != H or q.dtype not in (jnp.float32, jnp.bfloat16)):
        raise ValueError("prep='kernel' takes the raw q [B, H, c] (f32 or bf16), c2=None and the logit scale")
    stride = row_stride(c)
    wg_bytes = S * KEYS * stride  # one warpgroup's stages
    if NW > 1 and wg_bytes < 4 * HEADS * R:
        raise ValueError(f"{S} stage(s) of {KEYS} rows cannot hold a warpgroup's partial o ({4 * HEADS * R} bytes)")
    nb_w = n_blk // NW  # blocks per warpgroup
    lead = (NW,) if NW > 1 else ()  # the scratch's warpgroup axis
    wg_ty = plgpu.Layout.WGMMA
    splat = plgpu.Layout.WG_SPLAT
    ref = plgpu.RefType()
    f32_acc = plgpu.ShapeDtypeStruct((KEYS, HEADS), jnp.float32, layout=wg_ty)
    init_barriers = plgpu.inline_mgpu(arg_types=(ref,))(_init_barriers_fn(S))
    q_ref_ty = plgpu.RefType(transforms=_q_transforms())
    prep_q = plgpu.inline_mgpu(arg_types=(ref, q_ref_ty, ref, ref) + (splat,) * (NW > 1))(_prep_q_fn(c, H, NW, PR))
    translate = plgpu.inline_mgpu(arg_types=(ref, ref) + ((splat,) if NW > 1 else ()))(
        _translate_fn(nb_w, NW, page, nblocks, max_blocks))
    issue = plgpu.inline_mgpu(arg_types=(ref,) * 4)(issue_fn(config.gather)(c, stride))
    wait = plgpu.inline_mgpu(arg_types=(ref, splat))(_wait_fn())
    if f8:
        f8_ty = plgpu.ShapeDtypeStruct((KEYS, 32), jnp.float8_e4m3fn, layout=plgpu.Layout.WGMMA_8BIT)
        logits_a = [plgpu.inline_mgpu(arg_types=(ref,), return_type=(f8_ty,) * (LC // 32))(
            _logits_operand_fp8_fn(j * LC, LC)) for j in range(c // LC)]
    else:
        logits_a = [plgpu.inline_mgpu(arg_types=(ref,),
                                      return_type=plgpu.ShapeDtypeStruct((KEYS, LC), jnp.float16, layout=wg_ty))(
            _logits_operand_fn(j * LC, LC)) for j in range(c // LC)]
    if v8:
        v8_ty = plgpu.ShapeDtypeStruct((R, 32), jnp.float8_e4m3fn, layout=plgpu.Layout.WGMMA_8BIT)
        value_a = [plgpu.inline_mgpu(arg_types=(ref,), return_type=v8_ty)(_value_operand_fp8_fn(R, g))
                   for g in range(KEYS // 32)]
        p8_ref = plgpu.RefType(transforms=_q_fp8_transforms())
        store_p = plgpu.inline_mgpu(arg_types=(wg_ty, p8_ref, p8_ref))(_store_p_fp8_fn())
    else:
        value_a = [plgpu.inline_mgpu(arg_types=(ref,),
                                     return_type=plgpu.ShapeDtypeStruct((R, VK), jnp.float16, layout=wg_ty))(
            _value_operand_fn(R, j * VK, VK)) for j in range(KEYS // VK)]
    softmax = plgpu.inline_mgpu(
        arg_types=(wg_ty, wg_ty, wg_ty, ref, ref, ref),
        return_type=(plgpu.ShapeDtypeStruct((KEYS, HEADS), jnp.float32 if v8 else jnp.float16, layout=wg_ty),
                     f32_acc, plgpu.ShapeDtypeStruct((R, HEADS), jnp.float32, layout=wg_ty)))(_softmax_fn(R, v8))
    init_stats = plgpu.inline_mgpu(return_type=f32_acc)(_init_stats_fn())
    finish = plgpu.inline_mgpu(arg_types=(wg_ty, wg_ty, ref, ref, ref))(
        _finish_fn(R, to_smem=NW > 1, out_scale=1 / P_SCALE if v8 else 1.0))
    combine = plgpu.inline_mgpu(arg_types=(ref, ref, ref, ref, splat))(_combine_fn(R, NW, wg_bytes))
    last_merge = plgpu.inline_mgpu(arg_types=(ref,) * 7 + (splat,) * (NW > 1))(_last_merge_fn(R, NS, NW, H, PR))
    stamp_at = plgpu.inline_mgpu(arg_types=(ref, splat))(_stamp_fn())
    release = plgpu.inline_mgpu(arg_types=(ref,))(_release_fn())

    def sparse_mla_mgpu(*refs, q_smem, idx_smem, c2_smem, rows_smem, p_smem, red_smem, bar_smem, q_bar, idx_bar,
                        lse_parts=None, done_bar=None, flag_smem=None, qraw_smem=None, q_lo_smem=None,
                        empty_smem=None, ready_bar=None):
        refs = list(refs)
        trace_ref = refs.pop() if trace else None
        slots_ref, bt_ref, q_ref = refs[:3]
        q_lo_ref = refs.pop(3) if f8 else None
        c2_ref = None if qk else refs.pop(3)
        pool_ref = refs[3]
        # prep="kernel" / merge="last": the scalars (logit scale, layer scale); "last": the per-sequence counters (a
        # mutable ref) in, the merged result out
        sc_ref = refs.pop(4) if qk or last else None
        cnt_ref = refs.pop(4) if last else None
        o_ref, lse_ref, o_fin, lse_fin = refs[4:] if last else (*refs[4:], None, None)
        sp = jax.lax.axis_index("s")
        b = jax.lax.axis_index("b")
        wg = jax.lax.axis_index("wg") if NW > 1 or PR else 0
        wg_arg = (wg.astype(jnp.int32),) if NW > 1 else ()
        def of(r, w):  # warpgroup w's part of a scratch (one warpgroup: the scratch has no warpgroup axis — a
            return r.at[w] if NW > 1 else r  # literal index 0 does not lower inside run_state)

        def mine(r):  # this warpgroup's part
            return of(r, wg)

        def bar_of(r, slot):  # a stage's mbarrier (8 bytes in an int32 scratch)
            return r.at[pl.ds(2 * slot, 2)]

        rows_wg, p_wg, red_wg, bar_wg = mine(rows_smem), mine(p_smem), mine(red_smem), mine(bar_smem)

        def stamp(pos):  # the timeline (trace=True): position pos of this CTA warpgroup's row
            if trace:
                stamp_at(trace_ref.at[sp, b, wg], jnp.asarray(pos, jnp.int32))

        # with a producer, the register file's split (one compute warpgroup: both keep the launch's 255)
        consumer_registers = ws_compute_registers(NW, PRODUCER_REGISTERS) if PR and NW > 1 else None

        def produce():  # the producer warpgroup (PR): every block of every compute warpgroup, stage by stage
            if consumer_registers:
                plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
            plgpu.barrier_wait(ready_bar)  # the consumers' barriers initialised, their slots translated
            for i in range(nb_w):
                for w in range(NW):
                    slot = i % S
                    if i >= S:  # warpgroup w released this stage's previous block (use i // S − 1 of it)
                        wait(bar_of(of(empty_smem, w), slot), jnp.asarray((i // S - 1) % 2, jnp.int32))
                    issue(pool_ref, of(rows_smem, w).at[slot], idx_smem.at[w + NW * i], bar_of(of(bar_smem, w), slot))
            for i in range(max(0, nb_w - S), nb_w):  # no exit with copies in flight: the last blocks released
                for w in range(NW):
                    wait(bar_of(of(empty_smem, w), i % S), jnp.asarray(i // S % 2, jnp.int32))

        def consume():  # a compute warpgroup
            if consumer_registers:
                plgpu.set_max_registers(consumer_registers, action="increase")
            stamp(0)
            init_barriers(bar_wg)
            if PR:
                init_barriers(mine(empty_smem))

            def load():  # by warpgroup 0; every warpgroup waits on idx_bar, then q_bar
                # the slots first, on their own barrier: the gathers start without waiting for q (27 KB raw at K3)
                plgpu.copy_gmem_to_smem(slots_ref.at[b, sp], idx_smem, idx_bar)
                plgpu.copy_gmem_to_smem(q_ref.at[b], qraw_smem if qk else q_smem, q_bar)  # raw q: [H·c/128, 128]
                if f8:
                    plgpu.copy_gmem_to_smem(q_lo_ref.at[b], q_lo_smem, q_bar)
                if not qk:
                    plgpu.copy_gmem_to_smem(c2_ref.at[b], c2_smem, q_bar)

            if NW > 1:
                pl.when(wg == 0)(load)
            else:
                load()

            plgpu.barrier_wait(idx_bar)
            translate(idx_smem, bt_ref.at[b], *wg_arg)  # this warpgroup's positions -> pool rows
            if PR:  # the producer may start
                plgpu.barrier_arrive(ready_bar)
            stamp(1)

            def bar(slot):
                return bar_of(bar_wg, slot)

            def block(i):  # the CTA's block row of this warpgroup's i-th block
                return wg + NW * i

            for s in range(0 if PR else min(S, nb_w)):
                issue(pool_ref, rows_wg.at[s], idx_smem.at[block(s)], bar(s))
            plgpu.barrier_wait(q_bar)
            if qk:  # while the first gathers are in flight (q is first read by the first block's logits)
                prep_q(qraw_smem, q_smem, c2_smem, sc_ref.at[pl.ds(0, 1)], *wg_arg)
            stamp(2)

            def step(i, carry):
                stats, out = carry
                slot = i % S
                wait(bar(slot), (i // S).astype(jnp.int32))
                stamp(3 + 2 * i)
                stage = rows_wg.at[slot]

                def logits(*accs):
                    for jj, fn in enumerate(logits_a):
                        acc = accs[jj % len(accs)]
                        if not f8:
                            plgpu.wgmma(acc, fn(stage), q_smem.at[:, pl.ds(jj * LC, LC)].T)
                        else:
                            for g, a in enumerate(fn(stage)):  # the stored bytes times q's hi and lo planes
                                cols = pl.ds(jj * LC + 32 * g, 32)
                                plgpu.wgmma(acc, a, plgpu.transpose_ref(q_smem.at[:, cols], (1, 0)))
                                plgpu.wgmma(acc, a, plgpu.transpose_ref(q_lo_smem.at[:, cols], (1, 0)))
                        if chunk_wait:  # this chunk's A registers are free after it
                            plgpu.wgmma_wait(0)
                    return functools.reduce(lambda x, y: x + y, [a[...] for a in accs])

                s_t = pl.run_scoped(logits, *[plgpu.ACC((KEYS, HEADS), jnp.float32) for _ in range(NA)])
                p, stats, out = softmax(s_t, stats, out, idx_smem.at[block(i)], red_wg.at[i % 2], c2_smem)
                if v8:  # P · 2^8 as e4m3 hi / lo planes, [heads, positions]
                    store_p(p, p_wg.at[0], p_wg.at[1])
                else:
                    p_wg[...] = p
                plgpu.commit_smem()

                def pv(acc):
                    if v8:
                        for g, fn in enumerate(value_a):
                            a, cols = fn(stage), pl.ds(32 * g, 32)
                            plgpu.wgmma(acc, a, plgpu.transpose_ref(p_wg.at[0, :, cols], (1, 0)))
                            plgpu.wgmma(acc, a, plgpu.transpose_ref(p_wg.at[1, :, cols], (1, 0)))
                            if chunk_wait:
                                plgpu.wgmma_wait(0)
                        return
                    for kk, fn in enumerate(value_a):
                        plgpu.wgmma(acc, fn(stage), p_wg.at[pl.ds(kk * VK, VK)])
                        if chunk_wait:
                            plgpu.wgmma_wait(0)

                out = pl.run_state(pv)(plgpu.ACC.init(out))
                stamp(4 + 2 * i)

                if PR:  # the producer refills it
                    release(bar_of(mine(empty_smem), slot))
                else:
                    @pl.when(i + S < nb_w)
                    def _refill():
                        issue(pool_ref, stage, idx_smem.at[block(i + S)], bar(slot))

                return stats, out

            zeros = plgpu.layout_cast(jnp.zeros((R, HEADS), jnp.float32), wg_ty)
            stats, out = jax.lax.fori_loop(0, nb_w, step, (init_stats(), zeros))
            if NW == 1:
                finish(stats, out, red_wg.at[nb_w % 2], o_ref.at[sp, b], lse_ref.at[sp, b])
            else:  # each warpgroup's partial into its own stages, then an exact merge of the NW partials
                finish(stats, out, red_wg.at[nb_w % 2], rows_wg, lse_parts.at[wg])
                plgpu.barrier_arrive(done_bar)
                plgpu.barrier_wait(done_bar)
                combine(rows_smem, lse_parts, o_ref.at[sp, b], lse_ref.at[sp, b], *wg_arg)
            stamp(3 + 2 * nb_w)
            if last:  # the sequence's last split to get here merges them all
                last_merge(o_ref.at[:, b], lse_ref.at[:, b], cnt_ref.at[pl.ds(b, 1)], flag_smem, o_fin.at[b],
                           lse_fin.at[b], sc_ref.at[pl.ds(1, 1)], *wg_arg)
            stamp(4 + 2 * nb_w)

        if PR:
            pl.when(wg == NW)(produce)
            pl.when(wg < NW)(consume)
        else:
            consume()

    out_type = (jax.ShapeDtypeStruct((NS, B, HEADS, R), jnp.float32), jax.ShapeDtypeStruct((NS, B, HEADS), jnp.float32))
    if last:  # + the merged result
        out_type += (jax.ShapeDtypeStruct((B, H, R), jnp.float32), jax.ShapeDtypeStruct((B, H), jnp.float32))
    if trace:
        out_type += (jax.ShapeDtypeStruct((NS, B, NW, 5 + 2 * nb_w), jnp.int32),)
    mesh = dict(grid=(NS, B), grid_names=("s", "b"))
    scratch = dict(
        q_smem=(plgpu.SMEM((HEADS, c), jnp.float8_e4m3fn, transforms=_q_fp8_transforms()) if f8 else
                plgpu.SMEM((HEADS, c), jnp.float16, **({"transforms": _q_transforms()} if qk else {}))),
        **({"q_lo_smem": plgpu.SMEM((HEADS, c), jnp.float8_e4m3fn, transforms=_q_fp8_transforms())} if f8 else {}),
        idx_smem=plgpu.SMEM((n_blk, KEYS), jnp.int32),
        c2_smem=plgpu.SMEM((HEADS,), jnp.float32),
        rows_smem=plgpu.SMEM(lead + (S, KEYS, stride), jnp.uint8),
        p_smem=(plgpu.SMEM(lead + (2, HEADS, KEYS), jnp.float8_e4m3fn, transforms=_q_fp8_transforms()) if v8 else
                plgpu.SMEM(lead + (KEYS, HEADS), jnp.float16)),
        red_smem=plgpu.SMEM(lead + (2, 4, HEADS), jnp.float32),
        bar_smem=plgpu.SMEM(lead + (2 * S,), jnp.int32),
        **(dict(empty_smem=plgpu.SMEM(lead + (2 * S,), jnp.int32), ready_bar=plgpu.Barrier(num_arrivals=NW))
           if PR else {}),
        q_bar=plgpu.Barrier(num_arrivals=1 if qk else 3 if f8 else 2),
        idx_bar=plgpu.Barrier(num_arrivals=1),
        **(dict(lse_parts=plgpu.SMEM((NW, HEADS), jnp.float32), done_bar=plgpu.Barrier(num_arrivals=NW))
           if NW > 1 else {}),
        **(dict(flag_smem=plgpu.SMEM((1,), jnp.int32)) if last else {}),
        **(dict(qraw_smem=plgpu.SMEM((H * c // 128, 128), q.dtype)) if qk else {}),
    )
    thread_kw = dict(num_threads=NW + PR, thread_name="wg") if NW > 1 or PR else {}
    params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)
    if qk:  # rows of 128: TMA boxes are at most 256 wide
        if (H * c) % 128:
            raise ValueError(f"prep='kernel' needs H·c a multiple of 128, got {H}·{c}")
        q = q.reshape(B, H * c // 128, 128)
    args = (slots, jnp.asarray(block_tables, jnp.int32), q) + ((q_lo,) if f8 else ()) + (() if qk else (c2,)) + (
        pool_u8,)
    if qk or last:
        ls = jnp.asarray(layer_scale, jnp.float32)
        args += (jnp.stack([ls * (scale if qk else 1.0), ls]),)
    if not last:
        return plgpu.kernel(sparse_mla_mgpu, out_type=out_type, **mesh, **thread_kw, scratch_types=scratch,
                            compiler_params=params)(*args)
    # "last": the counters are a mutable ref aliased in and out, which `plgpu.kernel`'s vmap wrapper cannot take —
    # launch through `pl.kernel` on the same mesh, the scratch allocated as `plgpu.kernel` does
    counters = jax.new_ref(jnp.zeros((B,), jnp.int32))

    def body(*refs):
        pl.run_scoped(functools.partial(sparse_mla_mgpu, *refs), collective_axes=thread_kw.get("thread_name", ()),
                      **scratch)

    out = pl.kernel(body, out_type=out_type, mesh=plgpu.Mesh(**mesh, **thread_kw), compiler_params=params,
                    name="sparse_mla_mgpu")(*args, counters)
    return (out[2], out[3]) + tuple(out[4:])


@functools.partial(jax.jit, static_argnames=("fmt", "scale", "value_dim", "config"))
def decode(q_bhc, kv_parts, block_tables, idx_bk, *, fmt, scale: float, value_dim: int, layer_scale=1.0,
           config: MgpuSparseConfig = MgpuSparseConfig()):
    """`sparse_gpu.decode`'s contract for fp8 rows at storage precision: q `[B, H, c]` (H ≤ 16), kv_parts the
    pool's one fp8 part `[num_blocks, page, c]`, block_tables `[B, max_blocks]`, idx `[B, k]` positions (−1 =
    empty) -> (o `[B, H, R]` f32, lse `[B, H]` f32). The splits' partials are merged by `sparse_gpu`'s Pallas
    merge kernel (one launch; it also drops the padded heads and applies the layer scale)."""
    if not supports(fmt):
        raise ValueError(f"the mgpu sparse MLA kernel reads fp8 rows with R in (128, 256, 512), not {fmt}")
    R = fmt.latent
    if value_dim != R:
        raise ValueError(f"value_dim must be the latent width {R}, got {value_dim}")
    (pool,) = kv_parts
    nblocks, page, c = pool.shape
    B, H, _ = q_bhc.shape
    ls = jnp.asarray(layer_scale, jnp.float32)
    if config.prep == "kernel":
        q, c2 = (q_bhc if q_bhc.dtype in (jnp.float32, jnp.bfloat16) else q_bhc.astype(jnp.float32)), None
    elif config.logits_mma == "fp8":
        q_hi, q_lo, c2 = prepare_q_fp8(q_bhc, scale * ls)
        q = (q_hi, q_lo)
    else:
        q, c2 = prepare_q(q_bhc, scale * ls)
    slots = prepare_slots(idx_bk, config.splits, config.warpgroups)
    pool_u8 = jax.lax.bitcast_convert_type(pool, jnp.uint8).reshape(nblocks * page, c)
    o, lse = kernel_call(q, c2, slots, block_tables, pool_u8, R=R, page=page, config=config, H=H,
                         layer_scale=ls, scale=scale)
    if config.merge == "last":
        return o, lse
    return merge(o, lse, H, ls)


def merge(o, lse, H: int, layer_scale, interpret: bool = False):
    """Per-split (o `[NS, B, 16, R]`, lse `[NS, B, 16]`) -> (o `[B, H, R]` · layer scale, lse `[B, H]`)."""
    if o.shape[0] == 1:
        return o[0, :, :H] * layer_scale, lse[0, :, :H]
    return _merge_pallas(o, lse, layer_scale, H, interpret=interpret)
