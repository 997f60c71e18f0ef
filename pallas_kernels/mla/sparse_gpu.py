"""Pallas (Triton lowering) GPU kernel: sparse MLA decode over the paged latent cache (one query per sequence).

Same contract as `sparse.sparse_mla` with T = 1, for every latent format (bf16, fp8 e4m3, nvfp4), dequantised inside
the kernel. The reference is `sparse.online_softmax_attention` over `fmt.dequantize` rows (`sparse.sparse_mla(...,
backend="reference")`).

Grid (B, H / BH, NS): sequence b, a block of BH heads, and one of NS splits of the k selected slots (flash-decoding:
with few sequences the k axis gives the parallelism). A program walks its k / NS slots in blocks of BK: it reads the
slot positions, maps them through the block table to pool rows (`table[pos // page]·page + pos % page`), gathers the
BK rows `[BK, c]` straight from the pool, dequantises them and runs an fp32 online softmax (m, l `[BH]`,
acc `[BH, R]`). Partial results over the NS disjoint slot sets are merged outside with their log-sum-exps
(`reference.merge_partials`, exact).

Precision. Every stored row is exact in the dot dtype: f16 for fp8 (e4m3) and nvfp4 (e2m1 × e4m3 scale: ≤ 6
significant bits, 2^-10 … 2688) rows, bf16 for bf16 rows (`dot_dtype`, "auto" picks). The fp32 operand (q for QKᵀ,
the probabilities p for PV) is split as x = hi + lo, and both halves are multiplied with fp32 accumulation (two
dots, summed): ≈ 2^-21 (f16) / 2^-15 (bf16) relative, inside the 1e-4 fp32 bar, at 2× the MMA work. q is split
outside the kernel by `split_hi_lo` (integer-mask truncation: XLA on GPU folds the plain lo = cdt(x − f32(cdt(x)))
to 0 — the H200's 1.6e-4 … 2.9e-4 / 2.3e-3 errors), p inside it (Triton keeps the round trip). Each head's q is divided by a power of two ≥ its max |q| beforehand (exact; multiplied back onto its
logits in fp32), so the halves sit well inside f16's range. `exact=False` drops the lo halves (≈ 1e-3, FlashMLA-like).

Address safety: slot positions clamped ≥ 0 before use (−1 = empty, masked after the load), table reads clamped to
the row, block ids clamped into the pool; 1-byte pool parts of 2^31…2^32 bytes get 64-bit offsets (the Pallas
Triton lowering's int32 wrap: `pallas_kernels.paged.ensure_triton_wide_offsets`; the cause of the first H200 run's
CUDA_ERROR_ILLEGAL_ADDRESS at 128K × 32).

NVFP4 rows: the packed byte j holds latent elements 2j (low nibble) and 2j + 1 (high nibble), both in scale group
j // 8 of the R/16 e4m3 block scales. The kernel never interleaves: q's latent columns are permuted outside into
[even | odd], the two nibble planes are dotted separately, and the output comes back as [even | odd] halves that are
interleaved outside. The per-layer scale s is folded outside (q·(scale·s), o·s), as in the TPU kernel.

Shapes must be powers of two per loaded block (Triton): R, rope, and the head block BH (H is zero-padded up to a
multiple of BH; padded heads are dropped). K3.1: R = 512, rope = 64, H = 96 (BH = 16 -> 6 head blocks).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

try:  # present in jax 0.10.x and 0.11.x
    from jax.experimental.pallas import triton as pltriton
except ImportError:  # pragma: no cover - a jax without the Triton lowering
    pltriton = None

from ..codec import e2m1_value
from ..paged import pool_offsets_safe
from ..triton_prims import fp8_e4m3_to_f16
from .reference import merge_partials

SUPPORTED = ("bf16", "fp8", "nvfp4")
NVFP4_GROUP = 16


def available() -> bool:
    return pltriton is not None


def supports(fmt) -> bool:
    return getattr(fmt, "kv_dtype", None) in SUPPORTED


MIN_DOT = 16  # every tensor-core dot dimension must be ≥ 16 (smaller ones gave wrong results on the H200)


def _pow2(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


def fits(fmt) -> bool:
    """Whether the kernel compiles for this latent geometry on a GPU: power-of-two R and rope, every tensor-core dot
    dimension ≥ 16 (rope, and R/2 for the nvfp4 planes). "auto" falls back to the reference otherwise (e.g. the tiny
    preset: rope = 8)."""
    R, rope = getattr(fmt, "latent", 0), getattr(fmt, "rope", 0)
    return supports(fmt) and _pow2(R) and _pow2(rope) and rope >= 16 and R >= 32


def _dot_nt(a, b):
    """a [M, K] · b [N, K]ᵀ -> [M, N] float32."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _dot_nn(a, b):
    """a [M, K] · b [K, N] -> [M, N] float32."""
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _kernel(bt_ref, idx_ref, q_ref, qs_ref, *refs, kv_dtype: str, R: int, rope: int, BH: int, BK: int, n_blk: int,
            page: int, max_blocks: int, nblocks: int, exact: bool, cdt, BV=None, q_reload: bool = False,
            orient: str = "qk", slots_outside: bool = False, value_reload: bool = False, H=None,
            lazy: bool = False, qk_split: int = 1, convert_once=False):
    """One (sequence, head block, split). q_ref `[B, HB, P, BH, c]` in the dot dtype cdt (P = 2 planes hi | lo, or
    1; each head divided by the power of two in qs_ref `[B, Hp]` f32, multiplied back onto its logits);
    pool refs flattened to `[num_blocks·page, w]`; outputs o `[NS, B, Hp, R]` f32 (nvfp4: [even | odd] halves),
    lse `[NS, B, Hp]` f32.

    Address safety: slot positions are clamped ≥ 0 (empty slots, −1, are masked after the load), table reads to the
    row, block ids to [0, nblocks): no load leaves the pool whatever idx / the table hold; 1-byte parts of
    2^31…2^32 bytes get 64-bit offsets (`pallas_kernels.paged.ensure_triton_wide_offsets`).

    Opt-in variant knobs (the defaults give the original program): BV < R — a 4th grid axis over value-column blocks
    of BV ([even | odd] space for nvfp4): every program still scores all c columns (QKᵀ is recomputed per value
    block) but accumulates PV for its BV columns only (acc `[BH, BV]`: the register budget of a 64/128-head
    program); q_reload — q is re-read (L1/L2) inside the slot loop instead of being held across it; orient "kq" —
    the logits dot is rows·qᵀ `[BK, BH]` (the rows are the M side), transposed for the PV dot; slots_outside — idx_ref
    already holds pool rows (−1 = empty; `pool_rows`), so a step has one dependent load (row ids -> rows) instead of
    two (positions -> table -> rows); value_reload — the PV dot's rows are a second load of the same addresses (an
    L2 hit): Triton's pipeliner leaves a load that feeds two dots synchronous, and pipelines each of two loads that
    feed one dot each (cp.async into shared memory, overlapped with the previous block's math); H (q prepared in
    the kernel, exact=False, not nvfp4) — q_ref is the raw q `[B, H, c]` f32 and qs_ref the scalar `[1]` scale·s:
    the kernel scales q, finds each head's power of two (`_pow2_at_least`, = `_prep_q`'s frexp), loads heads ≥ H as
    zeros and converts to cdt — the bits `_prep_q` gives, without its three XLA launches; lazy — the running max
    (and with it the [BH, R] accumulator's rescale) moves only when some head's block max exceeds it by more than
    `LAZY_RESCALE` (p ≤ e^LAZY_RESCALE meanwhile: no overflow in f32 / f16): most steps skip the rescale's FMULs
    (the loop's largest float block after the conversions) and accumulate straight into the mma's C operand;
    qk_split (fp8 / bf16 rows) — the latent columns are taken in qk_split pieces (q, rows, accumulators), and the
    logits dot's pieces summed as a balanced tree: with one piece each warp's QKᵀ is ONE chain of c/16 dependent
    mma.sync (36 at K3's 576, SASS); the tree leaves ≈ qk_split/2 + 1 independent chains of (c/16)/qk_split·2
    (on the H200 neither knob made the K3 op faster: see `WIDE`); convert_once (fp8 rows, f16 dots) — the rows
    are converted by `triton_prims.fp8_e4m3_to_f16`, an op Triton may not duplicate: each gathered block is converted
    once, staged in shared memory as f16 and read by both dots with ldmatrix, instead of being converted once per
    dot from byte-wise reads of the fp8 buffer (the PV operand's column reads: LDS of 1-2 bytes each). One load
    feeds both dots (`decode` turns value_reload off) and Triton still pipelines it (cp.async): 690 instead of
    1,191 loop instructions per 32 rows and 185 instead of 255 registers at K3 (bench/triton_regs.py --sass);
    "value" stages only the PV dot's rows (their own load, as value_reload), where the byte-wise column reads
    were."""
    *pool_refs, o_ref, lse_ref = refs
    if value_reload:  # the pool passed a second time: a second load that CSE cannot merge with the first
        n_parts = len(pool_refs) // 2
        pool_refs, value_refs = pool_refs[:n_parts], pool_refs[n_parts:]
    b = pl.program_id(0)
    hb = pl.program_id(1)
    sp = pl.program_id(2)
    vsplit = BV is not None and BV < R
    vb = pl.program_id(3) if vsplit else None
    planes = (0, 1) if exact else (0,)
    nv = kv_dtype == "nvfp4"
    half = R // 2
    heads = pl.ds(hb * BH, BH)
    # q pieces [plane] -> (value-column pieces (nvfp4: even | odd planes), rope columns), loaded once
    cols = [(0, half), (half, half)] if nv else [(i * (R // qk_split), R // qk_split) for i in range(qk_split)]
    if H is not None:  # q prepared here (single plane, fp8 / bf16 rows)
        live_h = (hb * BH + jnp.arange(BH)) < H
        qscale = qs_ref[0]
        q_lat_f = [pltriton.load(q_ref.at[b, heads, pl.ds(c0, cw)], mask=live_h[:, None], other=0.0) * qscale
                   for (c0, cw) in cols]  # [BH, cw] each
        q_rope_f = pltriton.load(q_ref.at[b, heads, pl.ds(R, rope)], mask=live_h[:, None], other=0.0) * qscale
        q_max = jnp.max(jnp.abs(q_rope_f), axis=1)
        for piece in q_lat_f:
            q_max = jnp.maximum(q_max, jnp.max(jnp.abs(piece), axis=1))
        qs = _pow2_at_least(q_max)[:, None]  # [BH, 1]
        q_in = ([[(piece / qs).astype(cdt) for piece in q_lat_f]], [(q_rope_f / qs).astype(cdt)])
    else:
        qs = qs_ref[b, heads][:, None]  # [BH, 1] power-of-two q normalisation

    def load_q():
        if H is not None:
            return q_in
        return ([[q_ref[b, hb, p, :, pl.ds(c0, cw)] for (c0, cw) in cols] for p in planes],
                [q_ref[b, hb, p, :, pl.ds(R, rope)] for p in planes])

    if not q_reload:
        q_lat, q_rope = load_q()

    def vblock_of(slot):
        """The BV value columns of this program's block `[BK, BV]` in cdt (vsplit only; an L1 re-read of the row)."""
        if not nv:
            return pool_refs[0][slot, pl.ds(vb * BV, BV)].astype(cdt)
        packed_ref, scale_ref, _ = pool_refs
        per_plane = half // BV
        plane = vb // per_plane
        off = (vb % per_plane) * BV
        packed = packed_ref[slot, pl.ds(off, BV)].astype(jnp.int32)  # [BK, BV]
        s16 = scale_ref[slot, pl.ds(off // (NVFP4_GROUP // 2), BV // (NVFP4_GROUP // 2))].astype(jnp.float32)
        s_b = jnp.broadcast_to(s16[:, :, None], (BK, BV // (NVFP4_GROUP // 2), NVFP4_GROUP // 2)).reshape(BK, BV)
        code = jnp.where(plane == 0, packed & 0xF, packed >> 4)
        return (e2m1_value(code) * s_b).astype(cdt)

    def rows_of(slot, pool_refs=pool_refs, once=convert_once):
        """Dequantised pieces of the gathered rows in cdt: (value pieces [BK, R/qk_split] (nvfp4: the even and odd
        planes [BK, R/2])..., rope [BK, rope])."""
        if not nv:
            (pool,) = pool_refs
            cvt = fp8_e4m3_to_f16 if once else (lambda x: x.astype(cdt))
            lat = [cvt(pool[slot, pl.ds(c0, cw)]) for (c0, cw) in cols]
            rp = cvt(pool[slot, pl.ds(R, rope)])
            return lat, rp
        packed_ref, scale_ref, rope_ref = pool_refs
        packed = packed_ref[slot, :].astype(jnp.int32)  # [BK, R/2]
        s16 = scale_ref[slot, :].astype(jnp.float32)  # [BK, R/16]
        # byte j is in scale group j // 8: repeat each scale 8 times along the byte axis
        s_b = jnp.broadcast_to(s16[:, :, None], (BK, R // NVFP4_GROUP, NVFP4_GROUP // 2)).reshape(BK, half)
        even = (e2m1_value(packed & 0xF) * s_b).astype(cdt)  # exact: ≤ 6 significant bits, 2^-10 … 2688
        odd = (e2m1_value(packed >> 4) * s_b).astype(cdt)
        rp = rope_ref[slot, :].astype(cdt)
        return [even, odd], rp

    def step(j, carry):
        m, l, accs = carry  # [BH, 1], [BH, 1], list of [BH, R or R/2]
        base = (sp * n_blk + j) * BK
        pos_raw = idx_ref[b, pl.ds(base, BK)]  # [BK] int32, −1 = empty slot
        ok = pos_raw >= 0
        if slots_outside:  # pool rows already
            slot = jnp.minimum(jnp.maximum(pos_raw, 0), nblocks * page - 1)
        else:
            pos = jnp.maximum(pos_raw, 0)
            blk = bt_ref[b, jnp.minimum(pos // page, max_blocks - 1)]  # [BK] page ids (gather from the table row)
            blk = jnp.minimum(jnp.maximum(blk, 0), nblocks - 1)
            slot = blk * page + pos % page
        vals, rp = rows_of(slot, once=convert_once is True)
        q_lat_, q_rope_ = load_q() if q_reload else (q_lat, q_rope)
        s = None
        for p in range(len(planes)):  # hi and lo planes: separate dots, one fp32 sum (no reshape)
            if orient == "kq":
                x = _tree_sum([_dot_nt(rp, q_rope_[p])] + [_dot_nt(v, qp) for qp, v in zip(q_lat_[p], vals)]).T
            else:  # [BH, BK]
                x = _tree_sum([_dot_nt(q_rope_[p], rp)] + [_dot_nt(qp, v) for qp, v in zip(q_lat_[p], vals)])
            s = x if s is None else s + x
        s = jnp.where(ok[None, :], s * qs, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        if lazy:  # both −inf: nan > x is False (nothing to move); m = −inf < m_blk: inf > x (first rows: move)
            need = jnp.max(jnp.where(m_new - m > LAZY_RESCALE, 1, 0)) > 0
            m_new = jnp.where(need, m_new, m)
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        pexp = jnp.exp(s - m_use)  # [BH, BK]; −inf -> 0
        corr = jnp.exp(m - m_use)
        l = l * corr + jnp.sum(pexp, axis=1, keepdims=True)
        p_hi, p_lo = _split(pexp, exact, cdt)
        new = []
        pv_vals = ([vblock_of(slot)] if vsplit else
                   (rows_of(slot, value_refs, once=bool(convert_once))[0] if value_reload else vals))
        if lazy:  # corr = 1 on the skipped steps (m_use = m), so the accumulators are left as they are
            accs = jax.lax.cond(need, lambda a: [x * corr for x in a], lambda a: list(a), accs)
        for acc, v in zip(accs, pv_vals):
            pv = _dot_nn(p_hi, v)
            if exact:
                pv = pv + _dot_nn(p_lo, v)
            new.append(acc + pv if lazy else acc * corr + pv)
        return m_new, l, new

    pieces = [BV] if vsplit else [cw for (_, cw) in cols]
    init = (jnp.full((BH, 1), -jnp.inf, jnp.float32), jnp.zeros((BH, 1), jnp.float32),
            [jnp.zeros((BH, w_), jnp.float32) for w_ in pieces])
    m, l, accs = jax.lax.fori_loop(0, n_blk, step, init)
    good = l > 0
    inv = 1.0 / jnp.where(good, l, 1.0)
    for i, acc in enumerate(accs):
        o_ref[sp, b, heads, pl.ds(vb * BV if vsplit else cols[i][0], pieces[i])] = acc * inv
    lse = jnp.where(good, m + jnp.log(jnp.where(good, l, 1.0)), -jnp.inf)
    lse_ref[sp, b, heads] = lse.reshape(BH)


def _tree_sum(terms):
    """Pairwise sum, left to right within a level: a + b + c + d as (a + b) + (c + d). Triton folds each pair's
    second dot into the first's accumulator, so the pairs are independent mma chains."""
    while len(terms) > 1:
        terms = [terms[i] + terms[i + 1] if i + 1 < len(terms) else terms[i] for i in range(0, len(terms), 2)]
    return terms[0]


# lazy rescale threshold (natural-log units): probabilities stay ≤ e^8 ≈ 2981 between moves of the running max
LAZY_RESCALE = 8.0


def _pow2_at_least(m_f32):
    """m ≥ 0 (f32) -> the power of two 2^(e+1) for m's binary exponent e (> m), 1 where m = 0: `jnp.frexp`'s
    ldexp(1, E) for normal m (what `_prep_q` and the indexer's `pow2_scale` use), built from the exponent bits, for
    the kernels that prepare q themselves (frexp does not lower to Triton)."""
    e = (jax.lax.bitcast_convert_type(m_f32, jnp.int32) >> 23) & 0xFF
    return jnp.where(m_f32 > 0, jax.lax.bitcast_convert_type((e + 1) << 23, jnp.float32), 1.0)


def _split(x_f32, exact: bool, cdt):
    """In-kernel (Triton) hi/lo split of the probabilities. The f32 -> cdt -> f32 round trip is kept by Triton; it is
    NOT kept by XLA on GPU (see `split_hi_lo`, used for everything split outside the kernel)."""
    hi = x_f32.astype(cdt)
    if not exact:
        return hi, None
    return hi, (x_f32 - hi.astype(jnp.float32)).astype(cdt)


def split_hi_lo(x_f32, cdt):
    """x (float32, |x| ≤ 1 after the per-head power-of-two normalisation) -> (hi, lo) in cdt with x ≈ hi + lo:
    ≈ 2^-21 relative for f16, 2^-15 for bf16. For XLA-side code (the q planes built before the kernels).

    hi is x with its mantissa TRUNCATED by an integer mask to cdt's 11 (f16) / 8 (bf16) significant bits, so it is
    exact in cdt and lo = x − hi is exact in f32 (then rounded to cdt). The obvious `lo = x − f32(cdt(x))` is wrong
    on GPU: XLA's default `--xla_allow_excess_precision` (SimplifyFPConversions) removes the convert(convert(x, f16),
    f32) round trip, so lo = 0 and q keeps only cdt's mantissa (openxla/xla#41605; CPU keeps the round trip). That
    was the H200 error of the exact kernels: 1.6e-4 … 2.9e-4 (f16 q) and 2.3e-3 (bf16 q) relative RMS vs ~1e-6 in
    CPU interpret mode. Bit masks cannot be folded. f16: |x| < 2^-14 (f16 subnormal) goes wholly to lo (abs. error
    ≤ 2^-25)."""
    x = jnp.asarray(x_f32, jnp.float32)
    drop = {jnp.dtype(jnp.float16): 13, jnp.dtype(jnp.bfloat16): 16}[jnp.dtype(cdt)]
    mask = jnp.uint32((0xFFFFFFFF << drop) & 0xFFFFFFFF)
    hi32 = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(x, jnp.uint32) & mask, jnp.float32)
    if jnp.dtype(cdt) == jnp.dtype(jnp.float16):
        hi32 = jnp.where(jnp.abs(x) < 2.0 ** -14, 0.0, hi32)
    return hi32.astype(cdt), (x - hi32).astype(cdt)


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
    hi, lo = split_hi_lo(q, cdt)  # not `_split`: XLA on GPU would fold lo to 0
    return jnp.stack([hi, lo], axis=2), s


def _merge_kernel(o_ref, lse_ref, ls_ref, oo_ref, lo_ref, *, NS: int, BM: int, BR: int):
    """Split-k merge (`merge="pallas"`): one program per (sequence, block of BM heads, block of BR value columns)
    reads the NS partials (o `[NS, B, Hp, R]`, lse `[NS, B, Hp]`) and writes o `[B, H, R]` (times the layer scale)
    and lse `[B, H]` — exactly `reference.merge_partials`, in one launch instead of XLA's reduction fusions. The
    splits are a static loop (every partial's load independent of the others) and the columns a grid axis: the
    first version looped over the splits in one program per 4 heads, 96 programs at B = 32, H = 12, and took 8.5 µs
    on the H200 (ncu) for 4 MB."""
    b = pl.program_id(0)
    heads = pl.ds(pl.program_id(1) * BM, BM)
    cols = pl.ds(pl.program_id(2) * BR, BR)
    lses = [lse_ref[i, b, heads] for i in range(NS)]  # NS × [BM]
    m = functools.reduce(jnp.maximum, lses)
    m_use = jnp.where(m > -jnp.inf, m, 0.0)
    ws = [jnp.exp(x - m_use) for x in lses]  # −inf partials weigh 0
    tot = functools.reduce(jnp.add, ws)
    good = tot > 0
    scale = ls_ref[0] / jnp.where(good, tot, 1.0)  # [BM]
    acc = functools.reduce(jnp.add, [(w * scale)[:, None] * o_ref[i, b, heads, cols] for i, w in enumerate(ws)])
    oo_ref[b, heads, cols] = acc
    lo_ref[b, heads] = jnp.where(good, m_use + jnp.log(jnp.where(good, tot, 1.0)), -jnp.inf)  # same in every column


def _merge_pallas(o, lse, ls, H: int, *, interpret: bool, num_warps: int = 4, block_r: int = 128):
    NS, B, Hp, R = o.shape
    BM = 1
    while BM < 32 and H % (2 * BM) == 0:
        BM *= 2  # the largest power of two ≤ 32 dividing H: the output is [B, H, R] with no padded heads
    BR = min(block_r, R)
    return pl.pallas_call(
        functools.partial(_merge_kernel, NS=NS, BM=BM, BR=BR),
        grid=(B, H // BM, R // BR),
        out_shape=[jax.ShapeDtypeStruct((B, H, R), jnp.float32), jax.ShapeDtypeStruct((B, H), jnp.float32)],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="sparse_mla_merge",
    )(o, lse, jnp.reshape(ls, (1,)).astype(jnp.float32))


def _pick_splits(B: int, HB: int, n_total: int, target_programs: int = 264) -> int:
    """Splits of the k axis (a power of two, at most the block count) so B·HB·NS ≈ 2 programs per SM (H200: 132)."""
    ns = 1
    while B * HB * ns < target_programs and 2 * ns <= n_total:
        ns *= 2
    return ns


# Opt-in presets (issue #5 follow-up; not the model's default): every program handles ALL heads of one query (96 ->
# one 128-head block, or two 64-head blocks), so each gathered row is read and dequantised once per query (not
# H/16 times) and the dots have ≥ 64 rows; single-pass products (exact=False: the storage formats' 5e-3 bar); split-k
# over the slots with the merge in one Pallas kernel. The bench sweeps them (correctness-gated) against the default.
WIDE = {  # ptxas (triton 3.6, sm_90a) at K3.1, fp8 rows: regs / spill bytes / shared memory noted (limit 227 KB)
    "wide128_v256": dict(block_h=128, block_k=32, exact=False, num_warps=8, num_stages=1, block_v=256,
                         merge="pallas"),  # 255 / 0 / 180 KB: all 96 heads in one program, 2 value halves
    "wide64": dict(block_h=64, block_k=32, exact=False, num_warps=8, num_stages=2, merge="pallas"),  # 238/0/128 KB
    "wide64_bk64": dict(block_h=64, block_k=64, exact=False, num_warps=8, num_stages=1, merge="pallas"),  # 255/4/144
    "wide64_v256": dict(block_h=64, block_k=32, exact=False, num_warps=8, num_stages=1, block_v=256,
                        merge="pallas"),  # 186 / 0 / 108 KB
    "wide64_qr": dict(block_h=64, block_k=64, exact=False, num_warps=8, num_stages=2, q_reload=True,
                      merge="pallas"),  # 255 / 0 / 180 KB
    "w16_fast": dict(block_h=16, block_k=64, exact=False, num_warps=4, num_stages=2, merge="pallas"),
    # every gather software-pipelined (TTGIR: cp.async for the rows of both dots, none synchronous) —
    # pool rows computed outside (`pool_rows`) and the PV rows a second load (`value_reload`)
    "sr16_bk64": dict(block_h=16, block_k=64, exact=False, num_warps=8, num_stages=3, slots_outside=True,
                      value_reload=True, merge="pallas"),  # 199 / 0 / 91 KB
    "sr16_bk32": dict(block_h=16, block_k=32, exact=False, num_warps=4, num_stages=3, slots_outside=True,
                      value_reload=True, merge="pallas"),  # 255 / 0 / 55 KB
    "sr16_bk32_exact": dict(block_h=16, block_k=32, exact=True, num_warps=8, num_stages=3, slots_outside=True,
                            value_reload=True, merge="pallas"),  # 202 / 0 / 74 KB
    # Triton 3.6 gives a gather that hangs off a loaded index ONE shared-memory buffer up to num_stages = 4 (the
    # next block's copy waits for this block's dots: no overlap inside a program), two from 5, three from 8
    # (TTGIR `local_alloc` shapes, bench/triton_regs.py). Timed 2026-12-01 at 32K, B = 32, H = 12 (µs per call):
    # s5 with 8 splits 44.6 (the best; 43.4-44.5 in later rows), sr16_bk32 with 8 splits 45.3, s5 with the automatic
    # splits 58.2, bk16_s6 65.3 (51.5 with 8 splits), bk64_s5 71.4. The second buffer is worth ≈ 2%.
    "sr16_bk32_s5": dict(block_h=16, block_k=32, exact=False, num_warps=4, num_stages=5, slots_outside=True,
                         value_reload=True, merge="pallas"),  # 255 / 0 / 90 KB, 2 buffers
    "sr16_bk16_s6": dict(block_h=16, block_k=16, exact=False, num_warps=4, num_stages=6, slots_outside=True,
                         value_reload=True, merge="pallas"),  # 182 / 0 / 54 KB, 2 buffers
    "sr16_bk64_s5": dict(block_h=16, block_k=64, exact=False, num_warps=8, num_stages=5, slots_outside=True,
                         value_reload=True, merge="pallas"),  # 199 / 0 / 161 KB, 2 buffers
    # ncu on sr16_bk32_s5 (8 splits, B = 32, H = 12): 255 registers and 90 KB hold an SM to 2 programs
    # (8 warps), which issue 0.41 instructions per cycle per scheduler. Value halves per program (block_v = 256:
    # twice the programs, each recomputing QKᵀ from L2-resident rows) cut the registers
    "sr16_bk16_v256_s5": dict(block_h=16, block_k=16, exact=False, num_warps=4, num_stages=5, slots_outside=True,
                              value_reload=True, merge="pallas", block_v=256),  # 140 / 0 / 46 KB: 3 per SM
    "sr16_bk32_v256_s5": dict(block_h=16, block_k=32, exact=False, num_warps=4, num_stages=5, slots_outside=True,
                              value_reload=True, merge="pallas", block_v=256),  # 178 / 0 / 74 KB
    # the op around the kernel (ncu, B = 32, H = 12, 8 splits): 30 µs kernel + 8.5 µs merge + five small XLA
    # fusions (q's max, scale, pad; pool rows; slot pad) of 2.6-3.5 µs each. q prepared in the kernel removes three
    # of them (the merge kernel and the slot pad were rewritten for all presets). After (2026-12-01): three launches —
    # pool rows 3.4, kernel 31.6, merge 5.4 µs (ncu) — and 38.6 µs per call vs 42.5 with q prepared outside
    "sr16_bk32_s5_qi": dict(block_h=16, block_k=32, exact=False, num_warps=4, num_stages=5, slots_outside=True,
                            value_reload=True, merge="pallas", q_inside=True),  # 255 / 0 / 90 KB
    # the loop body's SASS (bench/triton_regs.py --sass: `loop`) has each warp's QKᵀ as ONE chain of 36
    # dependent HMMA (its [16, 8] tile over k = 576), a latency two warps per scheduler might not hide. Split
    # logits (qk_split: 1190 -> 982 loop instructions, chains of ≤ 8) and the lazy rescale (the [16, 512] f32
    # accumulator's 64 FMULs per thread skipped unless a max moves by > 8; 221 registers with both). Timed
    # 2026-12-01 at B = 32, H = 12, 8 splits: 38.7 / 39.0 / 39.8 µs (c8 / lz / c8_lz; 42.0 with 4 splits) vs 38.4 for
    # sr16_bk32_s5_qi — no gain. ncu (SourceCounters): 1.9 active warps per scheduler, 0.53 eligible, 0.41 issued;
    # stalls spread over fixed-latency waits (LDS, HMMA, F2FP: 22%), issue (22%), global (15%) and shared (15%)
    # dependencies: with 2 programs per SM no single chain dominates; the kernel needs fewer instructions per row
    # (≈ 137 warp-instructions per gathered row) AND more warps in flight, i.e. another structure (sparse_mgpu)
    "sr16_bk32_s5_qi_c8": dict(block_h=16, block_k=32, exact=False, num_warps=4, num_stages=5, slots_outside=True,
                               value_reload=True, merge="pallas", q_inside=True, qk_split=8),  # 255 / 0 / 90 KB
    "sr16_bk32_s5_qi_lz": dict(block_h=16, block_k=32, exact=False, num_warps=4, num_stages=5, slots_outside=True,
                               value_reload=True, merge="pallas", q_inside=True, lazy=True),  # 239 / 0 / 90 KB
    "sr16_bk32_s5_qi_c8_lz": dict(block_h=16, block_k=32, exact=False, num_warps=4, num_stages=5,
                                  slots_outside=True, value_reload=True, merge="pallas", q_inside=True, qk_split=8,
                                  lazy=True),  # 221 / 0 / 90 KB
    # the conversion staged once (`convert_once`): one load per block feeding both dots, converted by a
    # non-pure asm op and read by ldmatrix. Loop instructions per gathered row (all warps, bench/triton_regs.py
    # --sass with pip triton 3.6): 86 (bk32, 4 warps) / 131 (bk32, 8 warps) / 82 (bk64, 8 warps) vs 149 for
    # sr16_bk32_s5_qi. SLOWER on the H200 (B = 32, H = 12, 8 splits unless named; µs): co 53.6, co_s4 45.3,
    # co_w8 61.5, co_bk64_w8 50.1, co_bk16_s6 54.6, co ns16 63.2 / ns4 48.6, cv_s4 39.5, cv_s5 44.7 vs 38.3 for
    # sr16_bk32_s5_qi; at B = 1 co 14.4 vs 14.5. ncu: the H200's Triton (jaxlib's, not pip's) gives co 250
    # registers and 122 KB of shared memory (one staging buffer per dot operand): 1 program per SM, 0.15 issued per
    # scheduler cycle. The CPU screen's registers and shared memory are not the device's for this kernel
    "sr16_bk32_s5_qi_co": dict(block_h=16, block_k=32, exact=False, num_warps=4, num_stages=5, slots_outside=True,
                               merge="pallas", q_inside=True, convert_once=True),  # 185 / 0 / 93 KB
    "sr16_bk32_s4_qi_co": dict(block_h=16, block_k=32, exact=False, num_warps=4, num_stages=4, slots_outside=True,
                               merge="pallas", q_inside=True, convert_once=True),  # 184 / 0 / 74 KB, 1 buffer
    "sr16_bk32_w8_s5_qi_co": dict(block_h=16, block_k=32, exact=False, num_warps=8, num_stages=5,
                                  slots_outside=True, merge="pallas", q_inside=True,
                                  convert_once=True),  # 128 / 0 / 93 KB: 16 warps per SM
    "sr16_bk64_w8_s5_qi_co": dict(block_h=16, block_k=64, exact=False, num_warps=8, num_stages=5,
                                  slots_outside=True, merge="pallas", q_inside=True,
                                  convert_once=True),  # 136 / 0 / 167 KB
    "sr16_bk16_s6_qi_co": dict(block_h=16, block_k=16, exact=False, num_warps=4, num_stages=6, slots_outside=True,
                               merge="pallas", q_inside=True, convert_once=True),  # 178 / 0 / 56 KB
    # only the PV dot's rows staged (convert_once="value"; the logits dot keeps its own load and conversion): 907
    # loop instructions (s4) / 926 (s5) vs 1,191
    "sr16_bk32_s4_qi_cv": dict(block_h=16, block_k=32, exact=False, num_warps=4, num_stages=4, slots_outside=True,
                               value_reload=True, merge="pallas", q_inside=True,
                               convert_once="value"),  # 184 / 0 / 87 KB
    "sr16_bk32_s5_qi_cv": dict(block_h=16, block_k=32, exact=False, num_warps=4, num_stages=5, slots_outside=True,
                               value_reload=True, merge="pallas", q_inside=True,
                               convert_once="value"),  # 187 / 0 / 123 KB: 1 program per SM
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
    the H200 sweeps (device time per call at 32K): ≤ 16 heads `sr16_bk32_s5_qi` — at B ≥ 8
    sequences with 8 splits (38.6 µs; 42.5 with q prepared outside, 96 for the exact default at B = 32, H = 12,
    2026-12-01), below 8 with the automatic split count (14.8 vs 20.6 µs for the default settings at B = 1, H = 12,
    three launches instead of six) — and, for more heads, `wide128_v256` at B ≥ 8 (212 vs 482 µs at
    H = 96); below 8 sequences with more than 16 heads the default settings stay (empty dict: nothing faster measured)."""
    if H <= 16:
        return dict(WIDE["sr16_bk32_s5_qi"], **({"splits": 8} if B >= 8 else {}))
    if B < 8:
        return {}
    return dict(WIDE["wide128_v256"])


def supports_pool(kv_parts) -> bool:
    """Whether every row of these pool parts is addressable by the kernel (see `paged.pool_offsets_safe`)."""
    return pool_offsets_safe(kv_parts)


@functools.partial(jax.jit, static_argnames=("fmt", "scale", "value_dim", "block_h", "block_k", "splits", "exact",
                                             "interpret", "num_warps", "num_stages", "dot_dtype", "block_v",
                                             "q_reload", "orient", "merge", "target_programs", "slots_outside",
                                             "value_reload", "q_inside", "lazy", "qk_split", "convert_once"))
def decode(q_bhc, kv_parts, block_tables, idx_bk, *, fmt, scale: float, value_dim: int, layer_scale=1.0,
           block_h: int = 16, block_k: int = 32, splits=None, exact: bool = True, interpret: bool = False,
           num_warps: int = 4, num_stages: int = 2, dot_dtype: str = "auto", block_v=None, q_reload: bool = False,
           orient: str = "qk", merge: str = "xla", target_programs: int = 264, slots_outside: bool = False,
           value_reload: bool = False, q_inside: bool = False, lazy: bool = False, qk_split: int = 1,
           convert_once=False):
    """q `[B, H, c]` (absorbed query), kv_parts: the pool's latent parts `[num_blocks, page, w]` (fmt.parts),
    block_tables `[B, max_blocks]` int, idx `[B, k]` positions (−1 = empty)
    -> (o `[B, H, value_dim]` float32, lse `[B, H]` float32).

    Knobs (defaults = the model's program): block_h heads per program (≥ H: one program reads and dequantises each
    gathered row once for ALL heads; 96 heads pad to 128), block_k slots per step, splits of the k axis (None:
    ≈ target_programs programs), exact (False: single-pass products, q and p in the dot dtype only — the storage
    formats' 5e-3 bar), block_v / q_reload / orient (see `_kernel`), merge ("xla": `reference.merge_partials`;
    "pallas": `_merge_kernel`, one launch that also drops padded heads and applies the layer scale),
    slots_outside / value_reload (see `_kernel`), q_inside (q scaled, normalised, padded and converted in the kernel
    instead of by `_prep_q`, same bits; applies with exact=False, fp8 / bf16 rows and no q_reload, is ignored
    otherwise), lazy (the accumulator rescaled only when the running max moves by > `LAZY_RESCALE`; see `_kernel`),
    qk_split (latent column pieces, fp8 / bf16 rows without block_v, at most R/16, ignored otherwise: independent
    logits-dot chains; see `_kernel`), convert_once (fp8 rows with f16 dots, ignored otherwise: True — each
    gathered row converted once and staged for both dots, the pool passed once whatever value_reload says; "value"
    — only the PV dot's rows, from their own load (value_reload implied)),
    Triton num_warps / num_stages,
    dot_dtype. `WIDE` lists the all-heads single-pass presets the bench sweeps."""
    if not supports(fmt):
        raise ValueError(f"the GPU sparse MLA kernel reads {SUPPORTED} rows, not {fmt}")
    R, rope = fmt.latent, fmt.rope
    if value_dim != R:
        raise ValueError(f"value_dim must be the latent width {R}, got {value_dim}")
    if not (_pow2(R) and _pow2(rope) and _pow2(block_h) and _pow2(block_k)) or block_h < MIN_DOT:
        raise ValueError(f"latent {R}, rope {rope}, block_h {block_h}, block_k {block_k} must be powers of two "
                         f"(block_h ≥ {MIN_DOT})")
    BV = None if block_v is None or block_v >= R else block_v
    if not (isinstance(qk_split, int) and qk_split >= 1 and _pow2(qk_split)):
        raise ValueError(f"qk_split must be a power of two ≥ 1, got {qk_split!r}")
    # a performance knob, like q_inside: pieces of ≥ MIN_DOT columns, ignored where the columns are split otherwise
    qk_split = 1 if fmt.kv_dtype == "nvfp4" or BV is not None else min(qk_split, max(1, R // MIN_DOT))
    if BV is not None and not (_pow2(BV) and BV >= 16 and (fmt.kv_dtype != "nvfp4" or BV <= R // 2)):
        raise ValueError(f"block_v {block_v} must be a power of two in [16, R) (nvfp4: ≤ R/2)")
    if orient not in ("qk", "kq") or merge not in ("xla", "pallas"):
        raise ValueError(f"orient must be 'qk' / 'kq' and merge 'xla' / 'pallas', got {orient!r}, {merge!r}")
    B, H, c = q_bhc.shape
    nblocks, page = kv_parts[0].shape[:2]
    if not supports_pool(kv_parts):
        raise ValueError("this jax's Triton lowering would address the pool with wrapping 32-bit offsets "
                         "(a 1-byte part of 2^31…2^32 bytes); use the reference backend")
    bt = jnp.asarray(block_tables, jnp.int32)
    max_blocks = bt.shape[1]
    k = idx_bk.shape[-1]
    BK = max(MIN_DOT, min(block_k, 1 << (k - 1).bit_length()))  # ≥ 16: BK is the K side of the PV dot
    n_total = -(-k // BK)
    BH = block_h
    HB = -(-H // BH)
    NVB = R // BV if BV else 1
    NS = max(1, min(_pick_splits(B, HB * NVB, n_total, target_programs) if splits is None else splits, n_total))
    n_blk = -(-n_total // NS)  # key blocks per split; the slot list is padded with empty (−1) slots
    # padded with empty (−1) slots first: the pad then fuses into `pool_rows` (after it, XLA ran it as its own launch)
    idx = jnp.pad(jnp.asarray(idx_bk, jnp.int32), ((0, 0), (0, NS * n_blk * BK - k)), constant_values=-1)
    if slots_outside:
        idx = pool_rows(bt, idx, page, nblocks)
        bt = jnp.zeros((1, 1), jnp.int32)  # unused by the kernel
        max_blocks = 1
    ls = jnp.asarray(1.0 if fmt.kv_dtype == "bf16" else layer_scale, jnp.float32)  # bf16 rows are unscaled
    cdt = _dot_dtype(fmt, dot_dtype)
    # a performance knob: only fp8 rows into f16 dots have the conversion it stages
    if convert_once not in (False, True, "value"):
        raise ValueError(f"convert_once must be False, True or 'value', got {convert_once!r}")
    convert_once = convert_once if fmt.kv_dtype == "fp8" and cdt == jnp.float16 and BV is None else False
    if convert_once == "value":  # only the PV dot's rows staged: they come from their own load
        value_reload = True
    elif convert_once:
        value_reload = False
    # where it does not apply (hi/lo planes, nvfp4's column permutation, q re-read per step) q is prepared outside
    q_inside = q_inside and not (exact or fmt.kv_dtype == "nvfp4" or q_reload)
    if q_inside:
        q, qs = q_bhc.astype(jnp.float32), jnp.reshape(scale * ls, (1,)).astype(jnp.float32)
    else:
        q, qs = _prep_q(q_bhc, fmt, scale * ls, BH, exact, cdt)
    flat = [p.reshape(nblocks * page, p.shape[-1]) for p in kv_parts]

    kernel = functools.partial(_kernel, kv_dtype=fmt.kv_dtype, R=R, rope=rope, BH=BH, BK=BK, n_blk=n_blk,
                               page=page, max_blocks=max_blocks, nblocks=nblocks, exact=exact, cdt=cdt,
                               **({} if BV is None else dict(BV=BV)), **(dict(q_reload=True) if q_reload else {}),
                               **(dict(orient=orient) if orient != "qk" else {}),
                               **(dict(slots_outside=True) if slots_outside else {}),
                               **(dict(value_reload=True) if value_reload else {}),
                               **(dict(H=H) if q_inside else {}), **(dict(lazy=True) if lazy else {}),
                               **(dict(qk_split=qk_split) if qk_split > 1 else {}),
                               **(dict(convert_once=convert_once) if convert_once else {}))
    o, lse = pl.pallas_call(
        kernel,
        grid=(B, HB, NS) + ((NVB,) if BV else ()),
        out_shape=[jax.ShapeDtypeStruct((NS, B, HB * BH, R), jnp.float32),
                   jax.ShapeDtypeStruct((NS, B, HB * BH), jnp.float32)],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="sparse_mla_decode",
    )(bt, idx, q, qs, *flat, *(flat if value_reload else ()))
    if merge == "pallas" and NS > 1:
        o, lse = _merge_pallas(o, lse, ls, H, interpret=interpret)
        if fmt.kv_dtype == "nvfp4":  # [even | odd] -> interleaved
            o = jnp.stack([o[..., : R // 2], o[..., R // 2:]], axis=-1).reshape(B, H, R)
        return o, lse
    o, lse = (o[0], lse[0]) if NS == 1 else merge_partials(o, lse)
    o, lse = o[:, :H], lse[:, :H]
    if fmt.kv_dtype == "nvfp4":  # [even | odd] -> interleaved
        o = jnp.stack([o[..., : R // 2], o[..., R // 2:]], axis=-1).reshape(B, H, R)
    return o * ls, lse
