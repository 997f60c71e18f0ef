"""Native Triton GPU kernel (launched through jax-triton; CPU tests: Triton's interpreter): sparse MLA decode over the
paged latent cache, one query per sequence.

Same contract as `sparse.sparse_mla` with T = 1, for every latent format (bf16, fp8 e4m3, nvfp4), dequantised inside
the kernel. The reference is `sparse.online_softmax_attention` over `fmt.dequantize` rows (`sparse.sparse_mla(...,
backend="reference")`).

Grid (B, H / BH, NS · NVB): sequence b, a block of BH heads, and one of NS splits of the k selected slots
(flash-decoding: with few sequences the k axis gives the parallelism), times NVB value-column blocks (`block_v`; a
Triton grid has three axes). A program walks its k / NS slots in blocks of BK: it reads the slot positions, maps
them through the block table to pool rows (`table[pos // page]·page + pos % page`), gathers the BK rows `[BK, c]`
straight from the pool, dequantises them and runs an fp32 online softmax (m, l `[BH]`, acc `[BH, R]`). Partial
results over the NS disjoint slot sets are merged with their log-sum-exps (`reference.merge_partials` in XLA, or
one launch of `merge_splits`; exact).

Precision. Every stored row is exact in the dot dtype: f16 for fp8 (e4m3) and nvfp4 (e2m1 × e4m3 scale: ≤ 6
significant bits, 2^-10 … 2688) rows, bf16 for bf16 rows (`dot_dtype`, "auto" picks). The fp32 operand (q for QKᵀ,
the probabilities p for PV) is split as x = hi + lo, and both halves are multiplied with fp32 accumulation (two
dots, summed): ≈ 2^-21 (f16) / 2^-15 (bf16) relative, inside the 1e-4 fp32 bar, at 2× the MMA work. q is split
outside the kernel by `gpu_prep.split_hi_lo` (integer-mask truncation: XLA on GPU folds the plain
lo = cdt(x − f32(cdt(x))) to 0 — the H200's 1.6e-4 … 2.9e-4 / 2.3e-3 errors), p inside it (Triton keeps the round
trip). Each head's q is divided by a power of two ≥ its max |q| beforehand (exact; multiplied back onto its logits
in fp32), so the halves sit well inside f16's range. `exact=False` drops the lo halves (≈ 1e-3, FlashMLA-like).

Address safety: slot positions clamped ≥ 0 before use (−1 = empty, masked after the load), table reads clamped to
the row, block ids clamped into the pool; pool rows are int64 before they are multiplied by the row width, so pools
past 2^31 bytes need nothing special.

NVFP4 rows: the packed byte j holds latent elements 2j (low nibble) and 2j + 1 (high nibble), both in scale group
j // 8 of the R/16 e4m3 block scales. The kernel never interleaves: q's latent columns are permuted outside into
[even | odd], the two nibble planes are dotted separately, and the output comes back as [even | odd] halves that are
interleaved outside. The per-layer scale s is folded outside (q·(scale·s), o·s), as in the TPU kernel.

Shapes must be powers of two per loaded block (Triton): R, rope, and the head block BH (H is zero-padded up to a
multiple of BH; padded heads are dropped). K3.1: R = 512, rope = 64, H = 96 (BH = 16 -> 6 head blocks).
Plain `tl` operations only: the kernel compiles for ROCm too (fp8 rows need OCP e4m3, see docs/gpu.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..gpu_prep import MIN_DOT, is_pow2, split_hi_lo
from ..triton_call import available as _launcher_available
from ..triton_call import call, jit, tl
from ..triton_codec import e2m1_value, pow2_at_least
from .reference import merge_partials

__all__ = ["WIDE", "available", "causal_decode", "decode", "fits", "merge_splits", "pool_rows", "storage_preset",
           "supports"]

SUPPORTED = ("bf16", "fp8", "nvfp4")
FMT_CODE = {"bf16": 0, "fp8": 1, "nvfp4": 2}
CDT_CODE = {jnp.dtype(jnp.float16): 0, jnp.dtype(jnp.bfloat16): 1}


def available() -> bool:
    return _launcher_available()


def supports(fmt) -> bool:
    return getattr(fmt, "kv_dtype", None) in SUPPORTED


def fits(fmt) -> bool:
    """Whether the kernel compiles for this latent geometry on a GPU: power-of-two R and rope, every tensor-core dot
    dimension ≥ 16 (rope, and R/2 for the nvfp4 planes). "auto" falls back to the reference otherwise (e.g. the tiny
    preset: rope = 8)."""
    R, rope = getattr(fmt, "latent", 0), getattr(fmt, "rope", 0)
    return supports(fmt) and is_pow2(R) and is_pow2(rope) and rope >= 16 and R >= 32


def _dot_dtype(fmt, dot_dtype: str):
    """The tensor-core operand dtype: f16 where every stored row is exact in it (fp8 e4m3; nvfp4 = e2m1 × e4m3 scale,
    2^-10 … 2688 with ≤ 6 significant bits) — 11 mantissa bits for the q / p halves and the native e4m3 -> f16
    conversion — else bf16 (bf16 rows)."""
    if dot_dtype == "auto":
        dot_dtype = "bf16" if fmt.kv_dtype == "bf16" else "f16"
    if dot_dtype == "f16" and fmt.kv_dtype == "bf16":
        raise ValueError("dot_dtype f16 is not exact for bf16 latent rows")
    return {"f16": jnp.float16, "bf16": jnp.bfloat16}[dot_dtype]


def _prep_q(q_bhc, fmt, qscale, BH: int, exact: bool, cdt):
    """q `[B, H, c]` -> (q `[B, HB, P, BH, c]` in cdt, s `[B, HB·BH]` f32): scaled by qscale, each head divided by a
    power of two s ≥ its max |q| (the kernel multiplies its logits by s: exact), heads padded to HB·BH, nvfp4 latent
    columns permuted to [even | odd], hi/lo planes."""
    B, H, c = q_bhc.shape
    R = fmt.latent
    q = q_bhc.astype(jnp.float32) * qscale
    m = jnp.max(jnp.abs(q), axis=-1, keepdims=True)
    _, e = jnp.frexp(m)
    s = jnp.where(m > 0, jnp.ldexp(jnp.ones_like(m), e), 1.0)  # [B, H, 1]
    q = q / s
    if fmt.kv_dtype == "nvfp4":
        q = jnp.concatenate([q[..., 0:R:2], q[..., 1:R:2], q[..., R:]], axis=-1)
    HB = -(-H // BH)
    q = jnp.pad(q, ((0, 0), (0, HB * BH - H), (0, 0))).reshape(B, HB, BH, c)
    s = jnp.pad(s[..., 0], ((0, 0), (0, HB * BH - H)), constant_values=1.0)
    if not exact:
        return q.astype(cdt)[:, :, None], s
    hi, lo = split_hi_lo(q, cdt)  # not an f32 -> cdt -> f32 round trip: XLA on GPU would fold lo to 0
    return jnp.stack([hi, lo], axis=2), s


def _pick_splits(B: int, HB: int, n_total: int, target_programs: int = 264) -> int:
    """Splits of the k axis (a power of two, at most the block count) so B·HB·NS ≈ 2 programs per SM (H200: 132)."""
    ns = 1
    while B * HB * ns < target_programs and 2 * ns <= n_total:
        ns *= 2
    return ns


# Opt-in presets (issue #5 follow-up; not the model's default): every program handles ALL heads of one query (96 ->
# one 128-head block, or two 64-head blocks), so each gathered row is read and dequantised once per query (not
# H/16 times) and the dots have ≥ 64 rows; single-pass products (exact=False: the storage formats' 5e-3 bar); split-k
# over the slots with the merge in one kernel (`merge_splits`). The bench sweeps them (correctness-gated) against the
# default. The timings, ncu and ptxas figures below (registers / spill bytes / shared memory at K3.1, fp8 rows, triton
# 3.6, sm_90a; limit 227 KB) were measured on the Pallas Triton kernel this one replaced (issue #48), with the same
# knobs; docs/performance.md has the native kernel's. Variants of that kernel that measured no faster on the H200 and
# needed knobs this one does not carry (q re-read per step, split logits, lazy rescale, fp8 rows converted once
# through inline PTX) were dropped with it.
WIDE = {
    "wide128_v256": dict(block_h=128, block_k=32, exact=False, num_warps=8, num_stages=1, block_v=256,
                         merge="triton"),  # 255 / 0 / 180 KB: all 96 heads in one program, 2 value halves
    "wide64": dict(block_h=64, block_k=32, exact=False, num_warps=8, num_stages=2, merge="triton"),  # 238/0/128 KB
    "wide64_bk64": dict(block_h=64, block_k=64, exact=False, num_warps=8, num_stages=1, merge="triton"),  # 255/4/144
    "wide64_v256": dict(block_h=64, block_k=32, exact=False, num_warps=8, num_stages=1, block_v=256,
                        merge="triton"),  # 186 / 0 / 108 KB
    "w16_fast": dict(block_h=16, block_k=64, exact=False, num_warps=4, num_stages=2, merge="triton"),
    # every gather software-pipelined (TTGIR: cp.async for the rows of both dots, none synchronous) —
    # pool rows computed outside (`pool_rows`) and the PV rows a second load (`value_reload`)
    "sr16_bk64": dict(block_h=16, block_k=64, exact=False, num_warps=8, num_stages=3, slots_outside=True,
                      value_reload=True, merge="triton"),  # 199 / 0 / 91 KB
    "sr16_bk32": dict(block_h=16, block_k=32, exact=False, num_warps=4, num_stages=3, slots_outside=True,
                      value_reload=True, merge="triton"),  # 255 / 0 / 55 KB
    "sr16_bk32_exact": dict(block_h=16, block_k=32, exact=True, num_warps=8, num_stages=3, slots_outside=True,
                            value_reload=True, merge="triton"),  # 202 / 0 / 74 KB
    # Triton 3.6 gives a gather that hangs off a loaded index ONE shared-memory buffer up to num_stages = 4 (the
    # next block's copy waits for this block's dots: no overlap inside a program), two from 5, three from 8
    # (TTGIR `local_alloc` shapes). Timed 2026-12-01 at 32K, B = 32, H = 12 (µs per call):
    # s5 with 8 splits 44.6 (the best; 43.4-44.5 in later rows), sr16_bk32 with 8 splits 45.3, s5 with the automatic
    # splits 58.2, bk16_s6 65.3 (51.5 with 8 splits), bk64_s5 71.4. The second buffer is worth ≈ 2%.
    "sr16_bk32_s5": dict(block_h=16, block_k=32, exact=False, num_warps=4, num_stages=5, slots_outside=True,
                         value_reload=True, merge="triton"),  # 255 / 0 / 90 KB, 2 buffers
    "sr16_bk16_s6": dict(block_h=16, block_k=16, exact=False, num_warps=4, num_stages=6, slots_outside=True,
                         value_reload=True, merge="triton"),  # 182 / 0 / 54 KB, 2 buffers
    "sr16_bk64_s5": dict(block_h=16, block_k=64, exact=False, num_warps=8, num_stages=5, slots_outside=True,
                         value_reload=True, merge="triton"),  # 199 / 0 / 161 KB, 2 buffers
    # ncu on sr16_bk32_s5 (8 splits, B = 32, H = 12): 255 registers and 90 KB hold an SM to 2 programs
    # (8 warps), which issue 0.41 instructions per cycle per scheduler. Value halves per program (block_v = 256:
    # twice the programs, each recomputing QKᵀ from L2-resident rows) cut the registers
    "sr16_bk16_v256_s5": dict(block_h=16, block_k=16, exact=False, num_warps=4, num_stages=5, slots_outside=True,
                              value_reload=True, merge="triton", block_v=256),  # 140 / 0 / 46 KB: 3 per SM
    "sr16_bk32_v256_s5": dict(block_h=16, block_k=32, exact=False, num_warps=4, num_stages=5, slots_outside=True,
                              value_reload=True, merge="triton", block_v=256),  # 178 / 0 / 74 KB
    # the op around the kernel (ncu, B = 32, H = 12, 8 splits): 30 µs kernel + 8.5 µs merge + five small XLA
    # fusions (q's max, scale, pad; pool rows; slot pad) of 2.6-3.5 µs each. q prepared in the kernel removes three
    # of them (the merge kernel and the slot pad were rewritten for all presets). After (2026-12-01): three launches —
    # pool rows 3.4, kernel 31.6, merge 5.4 µs (ncu) — and 38.6 µs per call vs 42.5 with q prepared outside
    "sr16_bk32_s5_qi": dict(block_h=16, block_k=32, exact=False, num_warps=4, num_stages=5, slots_outside=True,
                            value_reload=True, merge="triton", q_inside=True),  # 255 / 0 / 90 KB
}


def pool_rows(block_tables, idx_bk, page: int, nblocks: int):
    """Top-k positions `[B, k]` (−1 = empty) -> rows of the flattened pool `[B, k]` int32 (−1 = empty):
    `table[b, pos // page]·page + pos % page`, table reads clamped to the row and block ids into [0, nblocks) as in
    the kernel. One XLA fusion (B·k·4 bytes) that takes the page-table step out of the kernel's dependent chain."""
    bt = jnp.asarray(block_tables, jnp.int32)
    pos = jnp.asarray(idx_bk, jnp.int32)
    safe = jnp.maximum(pos, 0)
    blk = jnp.take_along_axis(bt, jnp.minimum(safe // page, bt.shape[1] - 1), axis=1)
    blk = jnp.clip(blk, 0, nblocks - 1)
    return jnp.where(pos >= 0, blk * page + safe % page, -1)


def storage_preset(B: int, H: int) -> dict:
    """Kernel settings for `precision="storage"` (products at the storage formats' 5e-3 bar, not fp32-level), from
    the H200 sweeps of the Pallas twin (device time per call at 32K): ≤ 16 heads `sr16_bk32_s5_qi` — at B ≥ 8
    sequences with 8 splits (38.6 µs; 42.5 with q prepared outside, 96 for the exact default at B = 32, H = 12),
    below 8 with the automatic split count (14.8 vs 20.6 µs for the default settings at B = 1, H = 12, three
    launches instead of six) — and, for more heads, `wide128_v256` at B ≥ 8 (212 vs 482 µs at H = 96); below 8
    sequences with more than 16 heads the default settings stay (empty dict: nothing faster measured)."""
    if H <= 16:
        return dict(WIDE["sr16_bk32_s5_qi"], **({"splits": 8} if B >= 8 else {}))
    if B < 8:
        return {}
    return dict(WIDE["wide128_v256"])


@jit
def _to_cdt(x, CDT: tl.constexpr):
    if CDT == 0:
        out = x.to(tl.float16)
    else:
        out = x.to(tl.bfloat16)
    return out


@jit
def _nvfp4_plane(packed_ptr, scale_ptr, slot, col0, HIGH, W: tl.constexpr, R: tl.constexpr, CDT: tl.constexpr):
    """Columns [col0, col0 + W) of one nibble plane (HIGH: the odd elements) of the gathered nvfp4 rows `[BK, W]`
    in the dot dtype: e2m1 × the row's e4m3 block scale (byte j in scale group j // 8; exact in f16)."""
    cw = col0 + tl.arange(0, W)
    packed = tl.load(packed_ptr + slot[:, None] * (R // 2) + cw[None, :]).to(tl.int32)
    scale = tl.load(scale_ptr + slot[:, None] * (R // 16) + (cw // 8)[None, :]).to(tl.float32)
    code = tl.where(HIGH, packed >> 4, packed & 0xF)
    return _to_cdt(e2m1_value(code) * scale, CDT)


@jit
def _latent(pool_ptr, slot, col0, W: tl.constexpr, ROW: tl.constexpr, CDT: tl.constexpr):
    """Columns [col0, col0 + W) of the gathered bf16 / fp8 rows `[BK, W]` in the dot dtype (exact)."""
    return _to_cdt(tl.load(pool_ptr + slot[:, None] * ROW + col0 + tl.arange(0, W)[None, :]), CDT)


@jit
def _q_piece(q_ptr, b, hb, plane, col0, W: tl.constexpr, HB: tl.constexpr, P: tl.constexpr, BH: tl.constexpr,
             CW: tl.constexpr):
    """Columns [col0, col0 + W) of plane `plane` of the prepared q `[B, HB, P, BH, CW]` -> `[BH, W]`."""
    rows = ((b * HB + hb) * P + plane) * BH + tl.arange(0, BH)
    return tl.load(q_ptr + rows[:, None].to(tl.int64) * CW + col0 + tl.arange(0, W)[None, :])


@jit
def _sparse_kernel(bt_ptr, idx_ptr, q_ptr, qs_ptr, a_ptr, s_ptr, r_ptr, va_ptr, vs_ptr, o_ptr, lse_ptr,
                   FMT: tl.constexpr, R: tl.constexpr, ROPE: tl.constexpr, H: tl.constexpr, HB: tl.constexpr,
                   BH: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NVB: tl.constexpr, N_BLK: tl.constexpr,
                   NS: tl.constexpr, KP: tl.constexpr, PAGE: tl.constexpr, MAX_BLOCKS: tl.constexpr,
                   NBLOCKS: tl.constexpr, EXACT: tl.constexpr, CDT: tl.constexpr, SLOTS_OUTSIDE: tl.constexpr,
                   Q_INSIDE: tl.constexpr, CAUSAL: tl.constexpr):
    """Program (sequence b, head block hb, split sp · NVB + value block vb).

    q: prepared `[B, HB, P, BH, R + ROPE]` in the dot dtype (P = 2 planes hi | lo when EXACT; nvfp4 latent columns
    [even | odd]) with the per-head powers of two qs `[B, HB·BH]` f32, or (Q_INSIDE) the raw q `[B, H, R + ROPE]` f32
    and qs `[1]` = scale · layer scale. idx `[B, KP]`: positions (SLOTS_OUTSIDE: pool rows), −1 = empty; CAUSAL:
    idx `[B]` is each query's position p and the slots are positions 0 … p, split into NS near-equal runs of whole
    BK blocks (a split past p runs no step: the work follows the sequence, not the table's width). Pool parts
    flattened to rows: bf16 / fp8 rows `[rows, R + ROPE]` (a); nvfp4 packed `[rows, R/2]` (a), e4m3 scales
    `[rows, R/16]` (s), rope `[rows, ROPE]` (r). va / vs: the same value parts, read by the PV dot as a second load
    (`value_reload`) or the same pointers. out o `[NS, B, HB·BH, R]` f32 (nvfp4: [even | odd] halves), lse
    `[NS, B, HB·BH]` f32. BV < the value piece width (NVB > 1): this program accumulates value columns
    [vb·BV, (vb+1)·BV) only (in [even | odd] space for nvfp4), recomputing the logits."""
    b = tl.program_id(0)
    hb = tl.program_id(1)
    sp = tl.program_id(2) // NVB
    vb = tl.program_id(2) % NVB
    NV: tl.constexpr = FMT == 2
    HALF: tl.constexpr = R // 2
    PW: tl.constexpr = HALF if NV else R  # width of a value piece (nvfp4: one nibble plane)
    CW: tl.constexpr = R + ROPE
    ROW: tl.constexpr = R + ROPE if not NV else ROPE  # row width of part a (bf16 / fp8) or of the rope part
    P: tl.constexpr = 2 if EXACT else 1
    VSPLIT: tl.constexpr = NVB > 1
    heads = hb * BH + tl.arange(0, BH)

    # q pieces: latent (nvfp4: even and odd planes) and rope, hi and lo planes; qs [BH] powers of two
    if Q_INSIDE:  # single plane, bf16 / fp8 rows: scaled, normalised per head and converted here
        live = (heads < H)[:, None]
        qrow = q_ptr + b.to(tl.int64) * H * CW + heads[:, None] * CW
        qscale = tl.load(qs_ptr)
        lat_f = tl.load(qrow + tl.arange(0, R)[None, :], mask=live, other=0.0) * qscale
        rope_f = tl.load(qrow + R + tl.arange(0, ROPE)[None, :], mask=live, other=0.0) * qscale
        qs = pow2_at_least(tl.maximum(tl.max(tl.abs(lat_f), axis=1), tl.max(tl.abs(rope_f), axis=1)))
        qa_hi = _to_cdt(lat_f / qs[:, None], CDT)
        qr_hi = _to_cdt(rope_f / qs[:, None], CDT)
        qa_lo, qr_lo, qo_hi, qo_lo = qa_hi, qr_hi, qa_hi, qa_hi
    else:
        qs = tl.load(qs_ptr + b * (HB * BH) + heads)
        qa_hi = _q_piece(q_ptr, b, hb, 0, 0, PW, HB, P, BH, CW)
        qr_hi = _q_piece(q_ptr, b, hb, 0, R, ROPE, HB, P, BH, CW)
        qa_lo, qr_lo = qa_hi, qr_hi
        if EXACT:
            qa_lo = _q_piece(q_ptr, b, hb, 1, 0, PW, HB, P, BH, CW)
            qr_lo = _q_piece(q_ptr, b, hb, 1, R, ROPE, HB, P, BH, CW)
        qo_hi, qo_lo = qa_hi, qa_lo
        if NV:
            qo_hi = _q_piece(q_ptr, b, hb, 0, HALF, HALF, HB, P, BH, CW)
            qo_lo = qo_hi
            if EXACT:
                qo_lo = _q_piece(q_ptr, b, hb, 1, HALF, HALF, HB, P, BH, CW)

    m = tl.full([BH], float("-inf"), tl.float32)
    l = tl.zeros([BH], tl.float32)
    if VSPLIT:
        acc_a = tl.zeros([BH, BV], tl.float32)
    else:
        acc_a = tl.zeros([BH, PW], tl.float32)
    acc_o = tl.zeros([BH, PW], tl.float32)  # nvfp4's odd plane (unused otherwise)
    ar = tl.arange(0, BK)
    if CAUSAL:
        count = tl.maximum(tl.load(idx_ptr + b) + 1, 0)  # positions 0 … p
        per = tl.cdiv(tl.cdiv(count, NS), BK)  # blocks per split
        first = sp * per * BK
        n_steps = tl.minimum(tl.cdiv(tl.maximum(count - first, 0), BK), per)
    else:
        n_steps = N_BLK
    for j in range(0, n_steps):
        if CAUSAL:
            pos_raw = first + j * BK + ar
            pos_raw = tl.where(pos_raw < count, pos_raw, -1)
        else:
            pos_raw = tl.load(idx_ptr + b * KP + (sp * N_BLK + j) * BK + ar)  # [BK], −1 = empty
        ok = pos_raw >= 0
        if SLOTS_OUTSIDE:
            slot = tl.minimum(tl.maximum(pos_raw, 0), NBLOCKS * PAGE - 1)
        else:
            pos = tl.maximum(pos_raw, 0)
            blk = tl.load(bt_ptr + b * MAX_BLOCKS + tl.minimum(pos // PAGE, MAX_BLOCKS - 1))
            slot = tl.minimum(tl.maximum(blk, 0), NBLOCKS - 1) * PAGE + pos % PAGE
        slot = slot.to(tl.int64)
        # the rows: latent value pieces and rope [BK, .] in the dot dtype; logits [BH, BK] over the q planes
        if NV:
            even = _nvfp4_plane(a_ptr, s_ptr, slot, 0, False, HALF, R, CDT)
            odd = _nvfp4_plane(a_ptr, s_ptr, slot, 0, True, HALF, R, CDT)
            rope = _to_cdt(tl.load(r_ptr + slot[:, None] * ROPE + tl.arange(0, ROPE)[None, :]), CDT)
            s = tl.dot(qa_hi, tl.trans(even)) + tl.dot(qo_hi, tl.trans(odd)) + tl.dot(qr_hi, tl.trans(rope))
            if EXACT:
                s += tl.dot(qa_lo, tl.trans(even)) + tl.dot(qo_lo, tl.trans(odd)) + tl.dot(qr_lo, tl.trans(rope))
        else:
            even = _latent(a_ptr, slot, 0, R, ROW, CDT)
            odd = even
            rope = _latent(a_ptr, slot, R, ROPE, ROW, CDT)
            s = tl.dot(qa_hi, tl.trans(even)) + tl.dot(qr_hi, tl.trans(rope))
            if EXACT:
                s += tl.dot(qa_lo, tl.trans(even)) + tl.dot(qr_lo, tl.trans(rope))
        s = tl.where(ok[None, :], s * qs[:, None], float("-inf"))
        # online softmax (fp32): −inf rows stay at m = −inf, p = 0
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_use[:, None])
        corr = tl.exp(m - m_use)
        l = l * corr + tl.sum(p, axis=1)
        m = m_new
        p_hi = _to_cdt(p, CDT)
        p_lo = _to_cdt(p - p_hi.to(tl.float32), CDT)
        # the PV rows: this program's value block, a second load of the rows, or the logits' rows
        if VSPLIT:
            if NV:
                plane = (vb * BV) // HALF
                v_a = _nvfp4_plane(va_ptr, vs_ptr, slot, (vb * BV) % HALF, plane == 1, BV, R, CDT)
            else:
                v_a = _latent(va_ptr, slot, vb * BV, BV, ROW, CDT)
            v_o = v_a
        elif NV:
            v_a = _nvfp4_plane(va_ptr, vs_ptr, slot, 0, False, HALF, R, CDT)
            v_o = _nvfp4_plane(va_ptr, vs_ptr, slot, 0, True, HALF, R, CDT)
        else:
            v_a = _latent(va_ptr, slot, 0, R, ROW, CDT)
            v_o = v_a
        acc_a = acc_a * corr[:, None] + tl.dot(p_hi, v_a)
        if EXACT:
            acc_a += tl.dot(p_lo, v_a)
        if NV and not VSPLIT:
            acc_o = acc_o * corr[:, None] + tl.dot(p_hi, v_o)
            if EXACT:
                acc_o += tl.dot(p_lo, v_o)

    good = l > 0
    inv = 1.0 / tl.where(good, l, 1.0)
    out_row = (sp * tl.num_programs(0) + b).to(tl.int64) * (HB * BH) + heads  # [BH] rows of o [NS·B·Hp, R]
    if VSPLIT:
        tl.store(o_ptr + out_row[:, None] * R + vb * BV + tl.arange(0, BV)[None, :], acc_a * inv[:, None])
    else:
        tl.store(o_ptr + out_row[:, None] * R + tl.arange(0, PW)[None, :], acc_a * inv[:, None])
        if NV:
            tl.store(o_ptr + out_row[:, None] * R + HALF + tl.arange(0, PW)[None, :], acc_o * inv[:, None])
    lse = tl.where(good, m + tl.log(tl.where(good, l, 1.0)), float("-inf"))
    tl.store(lse_ptr + out_row, lse, mask=vb == 0)


@jit
def _merge_kernel(o_ptr, lse_ptr, ls_ptr, oo_ptr, lo_ptr, NS: tl.constexpr, B: tl.constexpr, HP: tl.constexpr,
                  H: tl.constexpr, R: tl.constexpr, BM: tl.constexpr, BR: tl.constexpr):
    """Split-k merge (`reference.merge_partials`, times the layer scale): program (sequence b, block of BM heads,
    block of BR value columns) reads the NS partials o `[NS, B, HP, R]`, lse `[NS, B, HP]` and writes o `[B, H, R]`
    and lse `[B, H]` (padded heads dropped; the same lse from every column block)."""
    b = tl.program_id(0)
    heads = tl.program_id(1) * BM + tl.arange(0, BM)
    cols = tl.program_id(2) * BR + tl.arange(0, BR)
    m = tl.full([BM], float("-inf"), tl.float32)
    for i in tl.static_range(NS):
        m = tl.maximum(m, tl.load(lse_ptr + (i * B + b) * HP + heads))
    m_use = tl.where(m > float("-inf"), m, 0.0)
    tot = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BR], tl.float32)
    for i in tl.static_range(NS):  # −inf partials weigh 0
        w = tl.exp(tl.load(lse_ptr + (i * B + b) * HP + heads) - m_use)
        rows = ((i * B + b) * HP + heads).to(tl.int64)
        acc += w[:, None] * tl.load(o_ptr + rows[:, None] * R + cols[None, :])
        tot += w
    good = tot > 0
    scale = tl.load(ls_ptr) / tl.where(good, tot, 1.0)
    out = (b * H + heads).to(tl.int64)
    tl.store(oo_ptr + out[:, None] * R + cols[None, :], acc * scale[:, None])
    tl.store(lo_ptr + out, tl.where(good, m_use + tl.log(tl.where(good, tot, 1.0)), float("-inf")))


def merge_splits(o, lse, ls, H: int, *, interpret: bool = False, num_warps: int = 4, block_r: int = 128):
    """Per-split partials o `[NS, B, Hp, R]`, lse `[NS, B, Hp]` (Hp ≥ H heads; −inf lse: an empty split) and the
    layer scale ls -> (o `[B, H, R]` · ls, lse `[B, H]`) float32 in one launch: `reference.merge_partials` exactly,
    padded heads dropped (also the Mosaic GPU sparse kernel's merge). `interpret`: Triton's interpreter."""
    NS, B, Hp, R = o.shape
    BM = 1
    while BM < 32 and H % (2 * BM) == 0:
        BM *= 2  # the largest power of two ≤ 32 dividing H: the output is [B, H, R] with no padded heads
    BR = min(block_r, R)
    return call(o, lse, jnp.reshape(ls, (1,)).astype(jnp.float32), kernel=_merge_kernel, grid=(B, H // BM, R // BR),
                out_shape=[jax.ShapeDtypeStruct((B, H, R), jnp.float32), jax.ShapeDtypeStruct((B, H), jnp.float32)],
                interpret=interpret, num_warps=num_warps, num_stages=1, name="sparse_mla_merge_triton",
                NS=NS, B=B, HP=Hp, H=H, R=R, BM=BM, BR=BR)


def decode(q_bhc, kv_parts, block_tables, idx_bk, *, fmt, scale: float, value_dim: int, layer_scale=1.0, **knobs):
    """q `[B, H, c]` (absorbed query), kv_parts: the pool's latent parts `[num_blocks, page, w]` (fmt.parts),
    block_tables `[B, max_blocks]` int, idx `[B, k]` positions (−1 = empty)
    -> (o `[B, H, value_dim]` float32, lse `[B, H]` float32).

    Knobs (defaults = the model's program; `WIDE` and `storage_preset` name measured sets): block_h heads per
    program (≥ H: one program reads and dequantises each gathered row once for ALL heads; 96 heads pad to 128),
    block_k slots per step, splits of the k axis (None: ≈ target_programs programs), exact (False: single-pass
    products, q and p in the dot dtype only — the storage formats' 5e-3 bar), dot_dtype, block_v (< the value piece
    width: each program accumulates PV for block_v value columns only — [even | odd] space for nvfp4 — recomputing
    the logits; the register budget of a 64/128-head program), merge ("xla": `reference.merge_partials`; "triton"
    (older name "pallas"): `merge_splits`, one launch that also drops padded heads and applies the layer scale),
    slots_outside (idx mapped to pool rows by `pool_rows` in XLA first: one dependent load per step instead of
    two), value_reload (the PV dot's rows are a second load of the same addresses, an L2 hit: Triton's pipeliner
    leaves a load that feeds two dots synchronous and pipelines each of two loads that feed one dot each), q_inside
    (q scaled, normalised per head, padded and converted in the kernel instead of by `_prep_q`, same bits; applies
    with exact=False and fp8 / bf16 rows, ignored otherwise), Triton num_warps / num_stages. `interpret`: Triton's
    interpreter on the host (CPU tests)."""
    return _decode(q_bhc, tuple(kv_parts), block_tables, idx_bk, layer_scale, fmt=fmt, scale=scale,
                   value_dim=value_dim, causal=False, **knobs)


def causal_decode(q_bhc, kv_parts, block_tables, query_pos_b, *, fmt, scale: float, value_dim: int,
                  layer_scale=1.0, **knobs):
    """Dense causal decode (`paged_dense.dense_paged_mla` with T = 1): each query attends to every position
    0 … query_pos of its sequence, read through its block table. q `[B, H, c]`, query_pos `[B]` int32 (< 0: a padding
    query, o = 0 and lse = −inf) -> (o `[B, H, value_dim]`, lse `[B, H]`) float32, equal to `decode` with
    idx = [0 … query_pos, −1 …]. Nothing is built per position: the kernel walks the positions itself, and the NS
    splits share each sequence's own length (a program past it runs no step), so a step's cost follows the
    sequences' lengths, not the block table's width. Knobs as `decode` (slots_outside does not apply)."""
    knobs["slots_outside"] = False
    return _decode(q_bhc, tuple(kv_parts), block_tables, query_pos_b, layer_scale, fmt=fmt, scale=scale,
                   value_dim=value_dim, causal=True, **knobs)


@functools.partial(jax.jit, static_argnames=("fmt", "scale", "value_dim", "causal", "block_h", "block_k", "splits",
                                             "exact", "interpret", "num_warps", "num_stages", "dot_dtype",
                                             "block_v", "merge", "target_programs", "slots_outside",
                                             "value_reload", "q_inside"))
def _decode(q_bhc, kv_parts, block_tables, idx, layer_scale, *, fmt, scale: float, value_dim: int, causal: bool,
            block_h: int = 16, block_k: int = 32, splits=None, exact: bool = True, interpret: bool = False,
            num_warps: int = 4, num_stages: int = 2, dot_dtype: str = "auto", block_v=None, merge: str = "xla",
            target_programs: int = 264, slots_outside: bool = False, value_reload: bool = False,
            q_inside: bool = False):
    """`decode` (idx `[B, k]` positions) or, `causal`, `causal_decode` (idx `[B]` query positions)."""
    if not supports(fmt):
        raise ValueError(f"the GPU sparse MLA kernel reads {SUPPORTED} rows, not {fmt}")
    R, rope = fmt.latent, fmt.rope
    if value_dim != R:
        raise ValueError(f"value_dim must be the latent width {R}, got {value_dim}")
    if not (is_pow2(R) and is_pow2(rope) and is_pow2(block_h) and is_pow2(block_k)) or block_h < MIN_DOT:
        raise ValueError(f"latent {R}, rope {rope}, block_h {block_h}, block_k {block_k} must be powers of two "
                         f"(block_h ≥ {MIN_DOT})")
    nv = fmt.kv_dtype == "nvfp4"
    BV = None if block_v is None or block_v >= (R // 2 if nv else R) else block_v
    if BV is not None and not (is_pow2(BV) and BV >= 16):
        raise ValueError(f"block_v {block_v} must be a power of two in [16, R) (nvfp4: ≤ R/2)")
    if merge not in ("xla", "pallas", "triton"):
        raise ValueError(f"merge must be 'xla' or 'triton' ('pallas': its older name), got {merge!r}")
    B, H, c = q_bhc.shape
    nblocks, page = kv_parts[0].shape[:2]
    bt = jnp.asarray(block_tables, jnp.int32)
    max_blocks = bt.shape[1]
    k = max_blocks * page if causal else idx.shape[-1]  # the most slots a query can have
    BK = max(MIN_DOT, min(block_k, 1 << (k - 1).bit_length()))  # ≥ 16: BK is the K side of the PV dot
    n_total = -(-k // BK)
    BH = block_h
    HB = -(-H // BH)
    NVB = R // BV if BV else 1
    NS = max(1, min(_pick_splits(B, HB * NVB, n_total, target_programs) if splits is None else splits, n_total))
    n_blk = -(-n_total // NS)  # key blocks per split; the slot list is padded with empty (−1) slots
    if causal:
        idx = jnp.asarray(idx, jnp.int32).reshape(B)
    else:
        idx = jnp.pad(jnp.asarray(idx, jnp.int32), ((0, 0), (0, NS * n_blk * BK - k)), constant_values=-1)
    if slots_outside:
        idx = pool_rows(bt, idx, page, nblocks)
    ls = jnp.asarray(1.0 if fmt.kv_dtype == "bf16" else layer_scale, jnp.float32)  # bf16 rows are unscaled
    cdt = _dot_dtype(fmt, dot_dtype)
    q_inside = q_inside and not (exact or nv)
    if q_inside:
        q, qs = q_bhc.astype(jnp.float32), jnp.reshape(scale * ls, (1,)).astype(jnp.float32)
    else:
        q, qs = _prep_q(q_bhc, fmt, scale * ls, BH, exact, cdt)
    flat = [p.reshape(nblocks * page, p.shape[-1]) for p in kv_parts]
    parts = flat if nv else flat * 3  # bf16 / fp8: one part (the scale and rope pointers are not read)
    # value_reload: the value parts passed again, so the PV dot's rows are a second load (other pointers: nothing
    # merges it with the logits' load) that Triton pipelines on its own; else the same rows feed both dots
    o, lse = call(bt, idx, q, qs, *parts, *parts[:2],
                  kernel=_sparse_kernel, grid=(B, HB, NS * NVB), interpret=interpret, num_warps=num_warps,
                  num_stages=num_stages, name="sparse_mla_decode_triton",
                  out_shape=[jax.ShapeDtypeStruct((NS, B, HB * BH, R), jnp.float32),
                             jax.ShapeDtypeStruct((NS, B, HB * BH), jnp.float32)],
                  FMT=FMT_CODE[fmt.kv_dtype], R=R, ROPE=rope, H=H, HB=HB, BH=BH, BK=BK, BV=BV or 16, NVB=NVB,
                  N_BLK=n_blk, NS=NS, KP=idx.shape[-1], PAGE=page, MAX_BLOCKS=max_blocks, NBLOCKS=nblocks,
                  EXACT=exact, CDT=CDT_CODE[jnp.dtype(cdt)], SLOTS_OUTSIDE=slots_outside, Q_INSIDE=q_inside,
                  CAUSAL=causal)
    if merge != "xla" and NS > 1:
        o, lse = merge_splits(o, lse, ls, H, interpret=interpret)
    else:
        o, lse = (o[0], lse[0]) if NS == 1 else merge_partials(o, lse)
        o, lse = o[:, :H] * ls, lse[:, :H]
    if nv:  # [even | odd] -> interleaved
        o = jnp.stack([o[..., : R // 2], o[..., R // 2:]], axis=-1).reshape(B, H, R)
    return o, lse
