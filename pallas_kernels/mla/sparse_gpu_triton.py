"""Native Triton GPU kernel (launched through jax-triton; CPU tests: Triton's interpreter): sparse MLA decode over the
paged latent cache, one query per sequence.

The algorithm, knobs and presets of the Pallas Triton kernel `sparse_gpu.py` (its docstring has the story: grid
(B, H / BH, NS) flash-decoding splits of the k selected slots, rows gathered straight from the pool through the
block table and dequantised in registers, an fp32 online softmax, the hi/lo planes of q and p for fp32-level
products, the per-head power-of-two q normalisation, nvfp4's [even | odd] column planes); the partials are merged by
`reference.merge_partials` or by the merge kernel here. Reference: `sparse.online_softmax_attention` over
`fmt.dequantize` rows (`sparse.sparse_mla(..., backend="reference")`).
What differs:
- Knobs: block_h, block_k, splits, exact, dot_dtype, block_v, slots_outside, value_reload, q_inside, merge, launch
  shapes — everything `storage_preset` and the `WIDE` presets use. The variants that measured no faster on the
  H200 (q_reload, orient "kq", lazy, qk_split, convert_once: inline PTX) stay in the Pallas module and raise here.
- Addressing: pool rows are int64 before they are multiplied by the row width, so pools past 2^31 bytes need no
  patch of a lowering (`paged.ensure_triton_wide_offsets` / `supports_pool` are for the Pallas kernel only).
- The value-column blocks (block_v) share grid axis 2 with the splits (a Triton grid has three axes).
- Plain `tl` operations only: the kernel compiles for ROCm too (fp8 rows need OCP e4m3, see docs/gpu.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..triton_call import available as _launcher_available
from ..triton_call import call, jit, tl
from ..triton_codec import e2m1_value, pow2_at_least
from .reference import merge_partials
from .sparse_gpu import (  # the knobs, presets and q preparation are shared with the Pallas kernel
    MIN_DOT, NVFP4_GROUP, SUPPORTED, WIDE, _dot_dtype, _pick_splits, _pow2, _prep_q, fits, pool_rows, storage_preset,
    supports)

__all__ = ["WIDE", "available", "decode", "fits", "storage_preset", "supports"]

FMT_CODE = {"bf16": 0, "fp8": 1, "nvfp4": 2}
CDT_CODE = {jnp.dtype(jnp.float16): 0, jnp.dtype(jnp.bfloat16): 1}
NOT_PORTED = dict(q_reload=False, orient="qk", lazy=False, qk_split=1, convert_once=False)


def available() -> bool:
    return _launcher_available()


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
                   Q_INSIDE: tl.constexpr):
    """Program (sequence b, head block hb, split sp · NVB + value block vb).

    q: prepared `[B, HB, P, BH, R + ROPE]` in the dot dtype (P = 2 planes hi | lo when EXACT; nvfp4 latent columns
    [even | odd]) with the per-head powers of two qs `[B, HB·BH]` f32, or (Q_INSIDE) the raw q `[B, H, R + ROPE]` f32
    and qs `[1]` = scale · layer scale. idx `[B, KP]`: positions (SLOTS_OUTSIDE: pool rows), −1 = empty. Pool parts
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
    for j in range(0, N_BLK):
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


def _merge(o, lse, ls, H: int, *, interpret: bool, num_warps: int = 4, block_r: int = 128):
    NS, B, Hp, R = o.shape
    BM = 1
    while BM < 32 and H % (2 * BM) == 0:
        BM *= 2  # the largest power of two ≤ 32 dividing H: the output is [B, H, R] with no padded heads
    BR = min(block_r, R)
    return call(o, lse, jnp.reshape(ls, (1,)).astype(jnp.float32), kernel=_merge_kernel, grid=(B, H // BM, R // BR),
                out_shape=[jax.ShapeDtypeStruct((B, H, R), jnp.float32), jax.ShapeDtypeStruct((B, H), jnp.float32)],
                interpret=interpret, num_warps=num_warps, num_stages=1, name="sparse_mla_merge_triton",
                NS=NS, B=B, HP=Hp, H=H, R=R, BM=BM, BR=BR)


@functools.partial(jax.jit, static_argnames=("fmt", "scale", "value_dim", "block_h", "block_k", "splits", "exact",
                                             "interpret", "num_warps", "num_stages", "dot_dtype", "block_v",
                                             "merge", "target_programs", "slots_outside", "value_reload",
                                             "q_inside", "q_reload", "orient", "lazy", "qk_split", "convert_once"))
def decode(q_bhc, kv_parts, block_tables, idx_bk, *, fmt, scale: float, value_dim: int, layer_scale=1.0,
           block_h: int = 16, block_k: int = 32, splits=None, exact: bool = True, interpret: bool = False,
           num_warps: int = 4, num_stages: int = 2, dot_dtype: str = "auto", block_v=None, merge: str = "xla",
           target_programs: int = 264, slots_outside: bool = False, value_reload: bool = False,
           q_inside: bool = False, q_reload: bool = False, orient: str = "qk", lazy: bool = False, qk_split: int = 1,
           convert_once=False):
    """As `sparse_gpu.decode` (same arguments, knobs and presets): q `[B, H, c]` (absorbed query), kv_parts the
    pool's latent parts `[num_blocks, page, w]` (fmt.parts), block_tables `[B, max_blocks]` int, idx `[B, k]`
    positions (−1 = empty) -> (o `[B, H, value_dim]` float32, lse `[B, H]` float32). merge "pallas" (the presets'
    name) and "triton" both take the merge kernel here; q_reload / orient / lazy / qk_split / convert_once must
    keep their defaults (not ported). `interpret`: Triton's interpreter on the host."""
    asked = dict(q_reload=q_reload, orient=orient, lazy=lazy, qk_split=qk_split, convert_once=convert_once)
    other = {k: v for k, v in asked.items() if v != NOT_PORTED[k]}
    if other:
        raise ValueError(f"the native Triton sparse MLA kernel does not carry {other} (sparse_gpu.py does)")
    if not supports(fmt):
        raise ValueError(f"the GPU sparse MLA kernel reads {SUPPORTED} rows, not {fmt}")
    R, rope = fmt.latent, fmt.rope
    if value_dim != R:
        raise ValueError(f"value_dim must be the latent width {R}, got {value_dim}")
    if not (_pow2(R) and _pow2(rope) and _pow2(block_h) and _pow2(block_k)) or block_h < MIN_DOT:
        raise ValueError(f"latent {R}, rope {rope}, block_h {block_h}, block_k {block_k} must be powers of two "
                         f"(block_h ≥ {MIN_DOT})")
    nv = fmt.kv_dtype == "nvfp4"
    BV = None if block_v is None or block_v >= (R // 2 if nv else R) else block_v
    if BV is not None and not (_pow2(BV) and BV >= 16):
        raise ValueError(f"block_v {block_v} must be a power of two in [16, R) (nvfp4: ≤ R/2)")
    if merge not in ("xla", "pallas", "triton"):
        raise ValueError(f"merge must be 'xla' or 'triton' ('pallas': the same merge kernel), got {merge!r}")
    B, H, c = q_bhc.shape
    nblocks, page = kv_parts[0].shape[:2]
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
    idx = jnp.pad(jnp.asarray(idx_bk, jnp.int32), ((0, 0), (0, NS * n_blk * BK - k)), constant_values=-1)
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
                  N_BLK=n_blk, NS=NS, KP=idx.shape[1], PAGE=page, MAX_BLOCKS=max_blocks, NBLOCKS=nblocks,
                  EXACT=exact, CDT=CDT_CODE[jnp.dtype(cdt)], SLOTS_OUTSIDE=slots_outside, Q_INSIDE=q_inside)
    if merge != "xla" and NS > 1:
        o, lse = _merge(o, lse, ls, H, interpret=interpret)
    else:
        o, lse = (o[0], lse[0]) if NS == 1 else merge_partials(o, lse)
        o, lse = o[:, :H] * ls, lse[:, :H]
    if nv:  # [even | odd] -> interleaved
        o = jnp.stack([o[..., : R // 2], o[..., R // 2:]], axis=-1).reshape(B, H, R)
    return o, lse
