"""KDA kernels for GPUs in native Triton (launched through jax-triton; CPU tests: Triton's interpreter): chunked
prefill and slot-addressed decode. The reference is `reference.recurrent_varlen` / `reference.recurrent_slots`.

Prefill over the packed [Ttot] token axis, chunks of C = 64 aligned to sequence starts (three launches):
  A1 `kda_intra_rows`  grid (chunks, H, 4): one 16-row sub-block i of chunk j — gates in base 2 (exp2 is one MUFU
      instruction, libdevice exp about eight), the earlier sub-blocks visited one [16, dk] tile at a time nearest
      first with the decay carried backwards (every exponent ≤ 0; no [64, dk] value in registers), the Akk / Aqk
      row blocks, the diagonal block (one matmul around a midpoint row when its decay range allows — always for the
      K3 gate — else the exact pairwise loop, a branch-free select at run time) and its inverse T_ii (loop-free,
      `chunk_math.unit_lower_inverse`, or by substitution), kg = k e^{Γ_last−Γ}, qg = q e^Γ, β k e^Γ, Γ_last.
  A2 `kda_intra_wu`    grid (chunks, H, wu_cols): W = T (β k e^Γ), U = T (β v) by block forward substitution
      W_i = T_ii (rhs_i − Σ_{m<i} Akk_im W_m), reading Akk and T_ii from memory (no off-diagonal T blocks); column
      tiles of dk / wu_cols.
  B  `kda_state`       grid (dv/BV, H, sequences), serial over a sequence's chunks, state [dk, BV] in registers:
      Vn = U − W S;  O = qg S + Aqk Vn;  S ← e^{Γ_last} S + kgᵀ Vn.
Decode `kda_decode`: grid (B, H/dec_heads, dv/BV), the state tile read from and written back to the pool row of the
slot (aliased: in place under donation), the gate formed in-kernel from raw f, A_log and dt_bias.
Launch shapes and the knobs above: `TUNING` (measured on the H200; `tuning=` overrides it per call).
Rows are int64 before they are multiplied by the row width, so no offset can wrap at long prefills. Plain `tl`
operations only: the kernels compile for ROCm too.
Products: fp32 inputs take IEEE fp32 dots (1e-4 bar); bf16 / f16 inputs take tensor-core dots on that dtype with
fp32 accumulation (`intra_mm="bf16"`) or TF32, the inverse of a diagonal block always IEEE fp32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import pallas_kernels.kda.chunk_math as M  # not `from . import`: see kda/ops.py

from ..triton_call import available as _launcher_available
from ..triton_call import call, jit, tl

__all__ = ["TUNING", "available", "chunk", "decode_step", "recurrent"]

C = 64
SUB = M.SUB
GATE_CODE = {None: 0, "lower_bound": 1, "plain": 2}
# dot operand codes (`_mm`): IEEE fp32, bf16 tensor cores, TF32, f16 tensor cores; fp32 accumulation in all
MM_IEEE, MM_BF16, MM_TF32, MM_F16 = 0, 1, 2, 3

# Launch configuration and knobs, by measurement on the H200 (with the Pallas Triton kernels these replaced, issue
# #48; callers may override per call through `tuning=`). rows_*: A1, wu_*: A2, state_*: B, dec_*: decode.
TUNING = dict(
    fast_diag=True,      # diagonal 16×16 blocks by one matmul when the decay range allows (chunk_math.FAST_DIAG_RANGE)
    fast_inverse=True,   # diagonal blocks of (I+Akk)^-1 by chunk_math.unit_lower_inverse instead of substitution
    # kernel B: one pipeline stage keeps its shared memory at 80 KB (144 KB with 2), two programs per SM; H200, 8K:
    # whole op 2.94 vs 2.98 ms
    state_bv=64, state_warps=4, state_stages=1,
    # decode: H200 233 µs at B = 64 vs 242 µs for BV = 64; dec_warps=None: 4 if dk·BV ≥ 4096, else 2
    dec_bv=128, dec_warps=4,
    dec_heads=1,         # heads per decode program (grid (B, H/dec_heads, dv/BV); 1 if it does not divide H)
    intra_mm="bf16",     # A1 / A2 products for bf16 inputs: "bf16" (tensor cores, fp32 acc.), "tf32", or
                         # "bf16_rows" (bf16 in A1, TF32 in A2); fp32 inputs always use IEEE fp32
    # A1 holds 255 registers per thread (ncu: 12.5% occupancy). An A1 that takes dk in 2–4 column parts (138–168
    # registers): 2.59–2.79 ms alone against 1.7 ms — the re-reads and recomputation cost more than the occupancy
    # gains — and is not kept; every register cap (`ttg.maxnreg`) spilled and was slower. H200, T = 8K, H = 96: A1
    # and A2 at 2 warps each, base-2 gates and bf16 A1 -> A2 intermediates: kernel A 1.97 ms, whole op 2.63 ms (the
    # first split form 3.49 ms, one program per chunk 6.80 ms). wu_cols: column tiles of W/U per (chunk, head), each
    # dk/wu_cols wide
    rows_warps=2, rows_stages=1,
    wu_cols=1, wu_warps=2, wu_stages=1,
)


def available() -> bool:
    return _launcher_available()


# ------------------------------------------------------------------------------------------------ device helpers

@jit
def _offsets(row0, h, col0, R: tl.constexpr, NC: tl.constexpr, H: tl.constexpr, W: tl.constexpr):
    """Element offsets [R, NC] (int64) of rows row0 … row0+R−1, head h, columns col0 … col0+NC−1 of a row-major
    [rows, H, W] array."""
    rows = (row0 + tl.arange(0, R)).to(tl.int64)
    return (rows[:, None] * H + h) * W + col0 + tl.arange(0, NC)[None, :]


@jit
def _mm(a, b, MM: tl.constexpr):
    """a @ b with fp32 accumulation; operands per MM (MM_IEEE, MM_BF16, MM_TF32, MM_F16)."""
    if MM == 0:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif MM == 1:
        out = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    elif MM == 2:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="tf32")
    else:
        out = tl.dot(a.to(tl.float16), b.to(tl.float16))
    return out


@jit
def _gate(f, a_h, dtb, GATE: tl.constexpr, LOWER: tl.constexpr):
    """Log-decay from the raw forget projection f (`reference.gate`): a_h = exp(A_log[h]), dtb dt_bias[h]
    broadcastable to f. GATE 1: lb·sigmoid(a (f + dtb)); 2: −a·softplus(f + dtb) (threshold 20)."""
    x = f + dtb
    if GATE == 1:
        out = LOWER / (1.0 + tl.exp(-a_h * x))
    else:
        out = -a_h * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    return out


@jit
def _gate_params(a_ptr, dtb_ptr, h, GATE: tl.constexpr, DK: tl.constexpr):
    """(exp(A_log[h]), dt_bias[h] [DK]) float32 for the in-kernel gate (ones / zeros without one)."""
    if GATE != 0:
        a_h = tl.exp(tl.load(a_ptr + h).to(tl.float32))
        dtb = tl.load(dtb_ptr + h * DK + tl.arange(0, DK)).to(tl.float32)
    else:
        a_h = 1.0
        dtb = tl.zeros([DK], tl.float32)
    return a_h, dtb


@jit
def _gate_block(g_ptr, a_h, dtb, st, L, m, h, H: tl.constexpr, DK: tl.constexpr, GATE: tl.constexpr,
                LOWER: tl.constexpr, SUB: tl.constexpr):
    """Sub-block m's gates [SUB, DK] in base-2 units (Γ·log2 e: each decay factor is one exp2), 0 past the chunk's
    L valid rows."""
    valid = (m * SUB + tl.arange(0, SUB)) < L
    g = tl.load(g_ptr + _offsets(st + m * SUB, h, 0, SUB, DK, H, DK), mask=valid[:, None], other=0.0)
    g = g.to(tl.float32)
    if GATE != 0:
        g = tl.where(valid[:, None], _gate(g, a_h, dtb[None, :], GATE, LOWER), 0.0)
    return g * 1.4426950408889634  # log2(e)


@jit
def _diag_block(cs, ki, qi, bi, tot, MM: tl.constexpr, FAST_DIAG: tl.constexpr, SUB: tl.constexpr):
    """One diagonal 16×16 sub-block (`chunk_math.diag_block`, base 2): Γ within the block cs [SUB, DK] (its rows
    minus the Γ before the block, ≤ 0), keys ki / queries qi [SUB, DK], β bi [SUB], tot = cs's last row [DK].
    Returns (Akk_ii β-scaled, strictly lower; Aqk_ii, lower incl. the diagonal), float32.

    FAST_DIAG: one matmul around the midpoint row m = tot/2 when the block's decay range is ≤ FAST_DIAG_RANGE
    (each factor then ≤ e^40; factors clamped so that the unused form stays finite); otherwise the exact pairwise
    loop runs (trip count 0 or SUB at run time, then a select: no branch region)."""
    row = tl.arange(0, SUB)[:, None]
    col = tl.arange(0, SUB)[None, :]
    HALF: tl.constexpr = 57.707801635558536  # 0.5 · FAST_DIAG_RANGE (80) in base-2 units
    if FAST_DIAG:
        m = 0.5 * tot
        e_r = tl.exp2(tl.minimum(cs - m[None, :], HALF))
        kc = ki * tl.exp2(tl.minimum(m[None, :] - cs, HALF))
        akk_f = _mm(ki * e_r, tl.trans(kc), MM)
        aqk_f = _mm(qi * e_r, tl.trans(kc), MM)
        ok = tl.max(-tot, axis=0) <= 2.0 * HALF
        n_exact = tl.where(ok, 0, SUB)
    else:
        n_exact = SUB
    akk = tl.zeros([SUB, SUB], tl.float32)
    aqk = tl.zeros([SUB, SUB], tl.float32)
    for c in range(0, n_exact):  # column c: exp(Γ_r − Γ_c) masked to r ≥ c before the exp
        pick = row == c
        g_c = tl.sum(tl.where(pick, cs, 0.0), axis=0)
        k_c = tl.sum(tl.where(pick, ki, 0.0), axis=0)
        kce = k_c[None, :] * tl.exp2(tl.where(row >= c, cs - g_c[None, :], float("-inf")))
        akk += tl.where(col == c, tl.sum(ki * kce, axis=1)[:, None], 0.0)
        aqk += tl.where(col == c, tl.sum(qi * kce, axis=1)[:, None], 0.0)
    if FAST_DIAG:
        akk = tl.where(ok, akk_f, akk)
        aqk = tl.where(ok, aqk_f, aqk)
    return tl.where(col < row, akk, 0.0) * bi[:, None], tl.where(col <= row, aqk, 0.0)


@jit
def _diag_inverse(L, FAST_INVERSE: tl.constexpr, SUB: tl.constexpr):
    """(I + L)^-1 of a strictly lower [SUB, SUB] block, IEEE fp32 (`chunk_math.diag_inverse`). FAST_INVERSE:
    (I + N)(I + N²)(I + N⁴)(I + N⁸) with N = −L, then one Newton step (`chunk_math.unit_lower_inverse`);
    else forward substitution, one row per step."""
    row = tl.arange(0, SUB)[:, None]
    col = tl.arange(0, SUB)[None, :]
    eye = (row == col).to(tl.float32)
    if FAST_INVERSE:
        nk = -L
        x = eye + nk
        for _ in tl.static_range(3):
            nk = _mm(nk, nk, 0)
            x = _mm(x, eye + nk, 0)
        x = x + _mm(x, eye - _mm(eye + L, x, 0), 0)
    else:
        lt = tl.trans(L)
        x = eye
        for r in range(1, SUB):  # row r of X: e_r − Σ_c L[r, c] X[c, :]
            l_r = tl.sum(tl.where(col == r, lt, 0.0), axis=1)
            x_r = tl.where(col == r, 1.0, 0.0) - tl.sum(l_r[:, None] * x, axis=0)[None, :]
            x = tl.where(row == r, x_r, x)
    return x


# ------------------------------------------------------------------------------------------------ prefill A1

@jit
def _intra_rows_kernel(start_ptr, len_ptr, q_ptr, k_ptr, g_ptr, b_ptr, a_ptr, dtb_ptr,
                       akk_ptr, tii_ptr, aqk_ptr, kg_ptr, qg_ptr, rk_ptr, gl_ptr,
                       H: tl.constexpr, DK: tl.constexpr, SCALE: tl.constexpr, GATE: tl.constexpr,
                       LOWER: tl.constexpr, MM: tl.constexpr, FAST_DIAG: tl.constexpr, FAST_INVERSE: tl.constexpr,
                       C: tl.constexpr, SUB: tl.constexpr):
    """A1, program (chunk j, head h, sub-block i). q, k, g (raw f with GATE) `[Ttot, H, DK]`, β `[Ttot, H]`.
    Writes the β-scaled Akk row blocks m < i `[Ttot, H, C]`, T_ii `[Ttot, H, SUB]`, the Aqk row `[Ttot, H, C]`
    (zeros above the diagonal: kernel B reads whole rows), kg, qg, β k e^Γ `[Ttot, H, DK]` and, for i = last,
    Γ_last `[chunks, H, DK]` (natural log units)."""
    j = tl.program_id(0)
    h = tl.program_id(1)
    i = tl.program_id(2)
    st = tl.load(start_ptr + j)
    L = tl.load(len_ptr + j)
    a_h, dtb = _gate_params(a_ptr, dtb_ptr, h, GATE, DK)
    valid = (i * SUB + tl.arange(0, SUB)) < L
    vk = valid[:, None]
    offs_k = _offsets(st + i * SUB, h, 0, SUB, DK, H, DK)
    offs_c = _offsets(st + i * SUB, h, 0, SUB, SUB, H, C)  # + m·SUB: column block m of the [.., C] rows
    gi = _gate_block(g_ptr, a_h, dtb, st, L, i, h, H, DK, GATE, LOWER, SUB)
    qi = tl.load(q_ptr + offs_k, mask=vk, other=0.0).to(tl.float32) * SCALE
    ki = tl.load(k_ptr + offs_k, mask=vk, other=0.0).to(tl.float32)
    bi = tl.load(b_ptr + (st + i * SUB + tl.arange(0, SUB)).to(tl.int64) * H + h, mask=valid, other=0.0)
    bi = bi.to(tl.float32)
    cs_i = tl.cumsum(gi, axis=0)  # Γ_r − Γ(start of i), ≤ 0
    tot_i = tl.sum(gi, axis=0)
    e_r = tl.exp2(cs_i)
    kr = ki * e_r
    qr = qi * e_r

    # earlier sub-blocks m = i−1 … 0, carrying D = Γ(start of i) − Γ(end of m) ≤ 0: the column factor
    # e^{start_i − Γ_c} = e^D · e^{Γ_end(m) − Γ_c} is a product of two factors ≤ 1
    d = tl.zeros([DK], tl.float32)
    for step in range(0, i):
        m = i - 1 - step
        gm = _gate_block(g_ptr, a_h, dtb, st, L, m, h, H, DK, GATE, LOWER, SUB)
        km = tl.load(k_ptr + _offsets(st + m * SUB, h, 0, SUB, DK, H, DK),
                     mask=((m * SUB + tl.arange(0, SUB)) < L)[:, None], other=0.0).to(tl.float32)
        tot_m = tl.sum(gm, axis=0)
        kc = tl.trans(km * tl.exp2(d[None, :] + (tot_m[None, :] - tl.cumsum(gm, axis=0))))
        tl.store(akk_ptr + offs_c + m * SUB, (bi[:, None] * _mm(kr, kc, MM)).to(akk_ptr.dtype.element_ty), mask=vk)
        tl.store(aqk_ptr + offs_c + m * SUB, _mm(qr, kc, MM).to(aqk_ptr.dtype.element_ty), mask=vk)
        d += tot_m
    start_i = d  # Γ before sub-block i
    after_i = tl.zeros([DK], tl.float32)  # Σ g of the later sub-blocks (to Γ_last)
    for step in range(0, C // SUB - 1 - i):
        after_i += tl.sum(_gate_block(g_ptr, a_h, dtb, st, L, i + 1 + step, h, H, DK, GATE, LOWER, SUB), axis=0)

    akk_ii, aqk_ii = _diag_block(cs_i, ki, qi, bi, tot_i, MM, FAST_DIAG, SUB)
    t_ii = _diag_inverse(akk_ii, FAST_INVERSE, SUB)
    tl.store(aqk_ptr + offs_c + i * SUB, aqk_ii.to(aqk_ptr.dtype.element_ty), mask=vk)
    for jj in range(i + 1, C // SUB):
        tl.store(aqk_ptr + offs_c + jj * SUB, tl.zeros([SUB, SUB], aqk_ptr.dtype.element_ty), mask=vk)
    tl.store(tii_ptr + _offsets(st + i * SUB, h, 0, SUB, SUB, H, SUB), t_ii.to(tii_ptr.dtype.element_ty), mask=vk)
    e_g = tl.exp2(start_i[None, :] + cs_i)  # e^{Γ_i}
    tl.store(kg_ptr + offs_k, (ki * tl.exp2((tot_i + after_i)[None, :] - cs_i)).to(kg_ptr.dtype.element_ty), mask=vk)
    tl.store(qg_ptr + offs_k, (qi * e_g).to(qg_ptr.dtype.element_ty), mask=vk)
    tl.store(rk_ptr + offs_k, (bi[:, None] * ki * e_g).to(rk_ptr.dtype.element_ty), mask=vk)
    last = (i == C // SUB - 1) & (tl.arange(0, DK) >= 0)
    tl.store(gl_ptr + (j * H + h).to(tl.int64) * DK + tl.arange(0, DK), (start_i + tot_i) * 0.6931471805599453,
             mask=last)  # ln 2: back to natural log units


# ------------------------------------------------------------------------------------------------ prefill A2

@jit
def _wu_rhs(rk_ptr, v_ptr, b_ptr, tii_ptr, st, L, i, h, p, H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
            BK: tl.constexpr, BVW: tl.constexpr, SUB: tl.constexpr):
    """Sub-block i's right-hand sides (β k e^Γ [SUB, BK], β v [SUB, BVW]; column tile p), T_ii and row mask."""
    valid = (i * SUB + tl.arange(0, SUB)) < L
    b = tl.load(b_ptr + (st + i * SUB + tl.arange(0, SUB)).to(tl.int64) * H + h, mask=valid, other=0.0)
    rk = tl.load(rk_ptr + _offsets(st + i * SUB, h, p * BK, SUB, BK, H, DK), mask=valid[:, None], other=0.0)
    v = tl.load(v_ptr + _offsets(st + i * SUB, h, p * BVW, SUB, BVW, H, DV), mask=valid[:, None], other=0.0)
    t_ii = tl.load(tii_ptr + _offsets(st + i * SUB, h, 0, SUB, SUB, H, SUB), mask=valid[:, None], other=0.0)
    return rk.to(tl.float32), b.to(tl.float32)[:, None] * v.to(tl.float32), t_ii, valid


@jit
def _akk(akk_ptr, st, L, i, m, h, H: tl.constexpr, C: tl.constexpr, SUB: tl.constexpr):
    """Block (i, m) of Akk [SUB, SUB], m < i."""
    valid = (i * SUB + tl.arange(0, SUB)) < L
    return tl.load(akk_ptr + _offsets(st + i * SUB, h, m * SUB, SUB, SUB, H, C), mask=valid[:, None], other=0.0)


@jit
def _store_wu(w_ptr, u_ptr, w, u, st, i, h, p, valid, H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
              BK: tl.constexpr, BVW: tl.constexpr, SUB: tl.constexpr):
    tl.store(w_ptr + _offsets(st + i * SUB, h, p * BK, SUB, BK, H, DK), w.to(w_ptr.dtype.element_ty),
             mask=valid[:, None])
    tl.store(u_ptr + _offsets(st + i * SUB, h, p * BVW, SUB, BVW, H, DV), u.to(u_ptr.dtype.element_ty),
             mask=valid[:, None])


@jit
def _intra_wu_kernel(start_ptr, len_ptr, rk_ptr, v_ptr, b_ptr, akk_ptr, tii_ptr, w_ptr, u_ptr,
                     H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BVW: tl.constexpr,
                     MM: tl.constexpr, C: tl.constexpr, SUB: tl.constexpr):
    """A2, program (chunk j, head h, column tile p): W = T (β k e^Γ) on columns [p·BK, (p+1)·BK) and U = T (β v) on
    [p·BVW, (p+1)·BVW), T = (I + Akk)^-1, by block forward substitution over the C/SUB = 4 sub-blocks:
    W_i = T_ii (rhs_i − Σ_{m<i} Akk_im W_m)."""
    j = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.program_id(2)
    st = tl.load(start_ptr + j)
    L = tl.load(len_ptr + j)
    rk, rv, t, valid = _wu_rhs(rk_ptr, v_ptr, b_ptr, tii_ptr, st, L, 0, h, p, H, DK, DV, BK, BVW, SUB)
    w0 = _mm(t, rk, MM)
    u0 = _mm(t, rv, MM)
    _store_wu(w_ptr, u_ptr, w0, u0, st, 0, h, p, valid, H, DK, DV, BK, BVW, SUB)

    rk, rv, t, valid = _wu_rhs(rk_ptr, v_ptr, b_ptr, tii_ptr, st, L, 1, h, p, H, DK, DV, BK, BVW, SUB)
    a = _akk(akk_ptr, st, L, 1, 0, h, H, C, SUB)
    w1 = _mm(t, rk - _mm(a, w0, MM), MM)
    u1 = _mm(t, rv - _mm(a, u0, MM), MM)
    _store_wu(w_ptr, u_ptr, w1, u1, st, 1, h, p, valid, H, DK, DV, BK, BVW, SUB)

    rk, rv, t, valid = _wu_rhs(rk_ptr, v_ptr, b_ptr, tii_ptr, st, L, 2, h, p, H, DK, DV, BK, BVW, SUB)
    a0 = _akk(akk_ptr, st, L, 2, 0, h, H, C, SUB)
    a1 = _akk(akk_ptr, st, L, 2, 1, h, H, C, SUB)
    w2 = _mm(t, rk - _mm(a0, w0, MM) - _mm(a1, w1, MM), MM)
    u2 = _mm(t, rv - _mm(a0, u0, MM) - _mm(a1, u1, MM), MM)
    _store_wu(w_ptr, u_ptr, w2, u2, st, 2, h, p, valid, H, DK, DV, BK, BVW, SUB)

    rk, rv, t, valid = _wu_rhs(rk_ptr, v_ptr, b_ptr, tii_ptr, st, L, 3, h, p, H, DK, DV, BK, BVW, SUB)
    a0 = _akk(akk_ptr, st, L, 3, 0, h, H, C, SUB)
    a1 = _akk(akk_ptr, st, L, 3, 1, h, H, C, SUB)
    a2 = _akk(akk_ptr, st, L, 3, 2, h, H, C, SUB)
    w3 = _mm(t, rk - _mm(a0, w0, MM) - _mm(a1, w1, MM) - _mm(a2, w2, MM), MM)
    u3 = _mm(t, rv - _mm(a0, u0, MM) - _mm(a1, u1, MM) - _mm(a2, u2, MM), MM)
    _store_wu(w_ptr, u_ptr, w3, u3, st, 3, h, p, valid, H, DK, DV, BK, BVW, SUB)


# ------------------------------------------------------------------------------------------------ prefill B

@jit
def _state_kernel(chunk0_ptr, nch_ptr, start_ptr, len_ptr, w_ptr, u_ptr, kg_ptr, qg_ptr, aqk_ptr, gl_ptr, s0_ptr,
                  o_ptr, sf_ptr, H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
                  MM: tl.constexpr, HAS_INIT: tl.constexpr, C: tl.constexpr):
    """Kernel B, program (value tile vb, head h, sequence n): the serial state chain over sequence n's chunks with
    the output. W, kg, qg `[Ttot, H, DK]`, U `[Ttot, H, DV]`, Aqk `[Ttot, H, C]`, Γ_last `[chunks, H, DK]` f32,
    initial states `[N, H, DK, DV]` f32 -> o `[Ttot, H, DV]`, final states `[N, H, DK, DV]` f32."""
    vb = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.program_id(2)
    c0 = tl.load(chunk0_ptr + n)
    nc = tl.load(nch_ptr + n)
    state = ((n * H + h).to(tl.int64) * DK + tl.arange(0, DK)[:, None]) * DV + vb * BV + tl.arange(0, BV)[None, :]
    if HAS_INIT:
        s = tl.load(s0_ptr + state).to(tl.float32)
    else:
        s = tl.zeros([DK, BV], tl.float32)
    for c in range(0, nc):
        j = c0 + c
        st = tl.load(start_ptr + j)
        valid = (tl.arange(0, C) < tl.load(len_ptr + j))[:, None]
        offs_k = _offsets(st, h, 0, C, DK, H, DK)
        offs_v = _offsets(st, h, vb * BV, C, BV, H, DV)
        w = tl.load(w_ptr + offs_k, mask=valid, other=0.0)
        u = tl.load(u_ptr + offs_v, mask=valid, other=0.0).to(tl.float32)
        kg = tl.load(kg_ptr + offs_k, mask=valid, other=0.0)
        qg = tl.load(qg_ptr + offs_k, mask=valid, other=0.0)
        a = tl.load(aqk_ptr + _offsets(st, h, 0, C, C, H, C), mask=valid, other=0.0)
        gl = tl.load(gl_ptr + (j * H + h).to(tl.int64) * DK + tl.arange(0, DK))
        vn = u - _mm(w, s, MM)
        o = _mm(qg, s, MM) + _mm(a, vn, MM)
        tl.store(o_ptr + offs_v, o.to(o_ptr.dtype.element_ty), mask=valid)
        s = s * tl.exp(gl)[:, None] + _mm(tl.trans(kg), vn, MM)
    tl.store(sf_ptr + state, s)


# ------------------------------------------------------------------------------------------------ decode

@jit
def _decode_kernel(slot_ptr, q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, a_ptr, dtb_ptr, pool_ptr, o_ptr, pool_out_ptr,
                   T: tl.constexpr, H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
                   HP: tl.constexpr, SCALE: tl.constexpr, GATE: tl.constexpr, LOWER: tl.constexpr):
    """Program (sequence b, heads hb·HP …, value tile vb): T tokens of the delta rule on the state tile
    `pool[slot[b], h, :, vb·BV …]` [DK, BV] f32, written back in place. q, k, g `[B, T, H, DK]`, v `[B, T, H, DV]`,
    β `[B, T, H]` -> o `[B, T, H, DV]`."""
    b = tl.program_id(0)
    vb = tl.program_id(2)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    ck = tl.arange(0, DK)
    cv = vb * BV + tl.arange(0, BV)
    for hh in tl.static_range(HP):  # independent [DK, BV] state tiles
        h = tl.program_id(1) * HP + hh
        state = ((slot * H + h) * DK + ck[:, None]) * DV + cv[None, :]
        s = tl.load(pool_ptr + state)
        a_h, dtb = _gate_params(a_ptr, dtb_ptr, h, GATE, DK)
        for t in tl.static_range(T):
            tok = (b * T + t) * H + h
            q = tl.load(q_ptr + tok * DK + ck).to(tl.float32) * SCALE
            k = tl.load(k_ptr + tok * DK + ck).to(tl.float32)
            v = tl.load(v_ptr + tok * DV + cv).to(tl.float32)
            g = tl.load(g_ptr + tok * DK + ck).to(tl.float32)
            if GATE != 0:
                g = _gate(g, a_h, dtb, GATE, LOWER)
            beta = tl.load(b_ptr + tok).to(tl.float32)
            s = s * tl.exp(g)[:, None]
            ks = tl.sum(k[:, None] * s, axis=0)
            s = s + k[:, None] * (beta * (v - ks))[None, :]
            tl.store(o_ptr + tok * DV + cv, tl.sum(q[:, None] * s, axis=0).to(o_ptr.dtype.element_ty))
        tl.store(pool_out_ptr + state, s)


@jit
def _conv_silu(x_ptr, tail_ptr, w_ptr, b, slot, col, P: tl.constexpr, K: tl.constexpr, KP: tl.constexpr):
    """Sequence b's causal conv + SiLU at columns `col` of a [B, P] projection over its tail rows
    `tail[slot, 0 … K−2, col]` (`reference.causal_conv`: taps summed in order, float32, the tail read in x's dtype)
    -> (SiLU output float32 rounded to x's dtype, x, the slot's next tail `[KP, len(col)]`: rows 1 … K−2 moved up
    one, x as row K−2, in the tail's dtype; rows ≥ K−1 unused)."""
    x = tl.load(x_ptr + b * P + col)
    y = tl.load(tail_ptr + slot * (K - 1) * P + col).to(x.dtype).to(tl.float32) * tl.load(w_ptr + col)
    for j in tl.static_range(1, K - 1):
        t_j = tl.load(tail_ptr + (slot * (K - 1) + j) * P + col)
        y += t_j.to(x.dtype).to(tl.float32) * tl.load(w_ptr + j * P + col)
    y += x.to(tl.float32) * tl.load(w_ptr + (K - 1) * P + col)
    r = tl.arange(0, KP)[:, None]
    later = tl.load(tail_ptr + (slot * (K - 1) + r + 1) * P + col[None, :], mask=r < K - 2, other=0.0)
    next_tail = tl.where(r == K - 2, x[None, :].to(tail_ptr.dtype.element_ty), later)
    return (y * tl.sigmoid(y)).to(x.dtype).to(tl.float32), next_tail


@jit
def _store_tail(tail_ptr, next_tail, slot, col, P: tl.constexpr, K: tl.constexpr, KP: tl.constexpr):
    r = tl.arange(0, KP)[:, None]
    tl.store(tail_ptr + (slot * (K - 1) + r) * P + col[None, :], next_tail, mask=r < K - 1)


@jit
def _decode_step_kernel(slot_ptr, q_ptr, k_ptr, v_ptr, f_ptr, bl_ptr, gl_ptr, cq_ptr, ck_ptr, cv_ptr, a_ptr, dtb_ptr,
                        on_ptr, pool_ptr, qt_ptr, kt_ptr, vt_ptr, o_ptr, pool_out_ptr, qt_out_ptr, kt_out_ptr,
                        vt_out_ptr, H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, K: tl.constexpr,
                        KP: tl.constexpr, SCALE: tl.constexpr, GATE: tl.constexpr, LOWER: tl.constexpr,
                        EPS: tl.constexpr):
    """Program (sequence b, head h): `reference.decode_step` for one head of one token — conv + SiLU of q, k, v
    over the slot's tails (updated in place), L2 norms, the gate from raw f, one delta-rule step on the state
    `pool[slot[b], h]` [DK, DV] f32 (in place), the gated RMSNorm of o -> o `[B, H·DV]` in v's dtype."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    ck = h * DK + tl.arange(0, DK)
    cv = h * DV + tl.arange(0, DV)
    q, q_tail = _conv_silu(q_ptr, qt_ptr, cq_ptr, b, slot, ck, H * DK, K, KP)
    k, k_tail = _conv_silu(k_ptr, kt_ptr, ck_ptr, b, slot, ck, H * DK, K, KP)
    v, v_tail = _conv_silu(v_ptr, vt_ptr, cv_ptr, b, slot, cv, H * DV, K, KP)
    act = o_ptr.dtype.element_ty
    # L2 norms (eps 1e-6 inside the root), rounded to the activation dtype as the reference's q and k are
    q = (q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6)).to(act).to(tl.float32) * SCALE
    k = (k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)).to(act).to(tl.float32)
    a_h, dtb = _gate_params(a_ptr, dtb_ptr, h, GATE, DK)
    g = _gate(tl.load(f_ptr + b * H * DK + ck).to(tl.float32), a_h, dtb, GATE, LOWER)
    beta = tl.sigmoid(tl.load(bl_ptr + b * H + h).to(tl.float32))
    state = ((slot * H + h) * DK + tl.arange(0, DK)[:, None]) * DV + tl.arange(0, DV)[None, :]
    s = tl.load(pool_ptr + state) * tl.exp(g)[:, None]
    ks = tl.sum(k[:, None] * s, axis=0)
    s = s + k[:, None] * (beta * (v - ks))[None, :]
    o = tl.sum(q[:, None] * s, axis=0).to(act).to(tl.float32)
    tl.debug_barrier()  # every tail row is read before any is overwritten (other threads may hold them)
    _store_tail(qt_out_ptr, q_tail, slot, ck, H * DK, K, KP)
    _store_tail(kt_out_ptr, k_tail, slot, ck, H * DK, K, KP)
    _store_tail(vt_out_ptr, v_tail, slot, cv, H * DV, K, KP)
    tl.store(pool_out_ptr + state, s)
    o = o * tl.rsqrt(tl.sum(o * o, axis=0) / DV + EPS) * tl.load(on_ptr + tl.arange(0, DV)).to(tl.float32)
    o = o * tl.sigmoid(tl.load(gl_ptr + b * H * DV + cv).to(tl.float32))
    tl.store(o_ptr + b * H * DV + cv, o.to(o_ptr.dtype.element_ty))


# ------------------------------------------------------------------------------------------------ wrappers

def _tuning(overrides):
    """`TUNING` with the per-call overrides applied; unknown keys raise."""
    tune = dict(TUNING)
    if overrides:
        unknown = set(overrides) - set(tune)
        if unknown:
            raise ValueError(f"unknown KDA GPU tuning keys {sorted(unknown)}; the knobs are {sorted(tune)}")
        tune.update(overrides)
    return tune


def _mm_code(dtype, intra_mm: str | None = None) -> int:
    """Dot operand code for inputs of `dtype`: fp32 -> IEEE; else `intra_mm` ("bf16": the input dtype, "tf32")."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float32:
        return MM_IEEE
    if intra_mm == "tf32":
        return MM_TF32
    if intra_mm not in (None, "bf16"):
        raise ValueError(f"intra_mm must be 'bf16', 'tf32' or 'bf16_rows', got {intra_mm!r}")
    return MM_F16 if dtype == jnp.float16 else MM_BF16


def _gate_arrays(H, dk, A_log, dt_bias, gate_form):
    if gate_form not in GATE_CODE:
        raise ValueError(f"unknown KDA gate form {gate_form!r}")
    if gate_form is None:
        return jnp.zeros((H,), jnp.float32), jnp.zeros((H, dk), jnp.float32)
    return jnp.asarray(A_log, jnp.float32).reshape(H), jnp.asarray(dt_bias, jnp.float32).reshape(H, dk)


def chunk(q, k, v, g, beta, cu_seqlens, initial_state=None, scale=None, *, A_log=None, dt_bias=None,
          gate_form=None, lower_bound=-5.0, interpret=False, tuning=None):
    """Packed prefill on GPU: q, k, g `[1, Ttot, H, dk]` (g: the raw forget projection f when `gate_form` is set,
    with A_log `[H]` and dt_bias `[H·dk]`), v `[1, Ttot, H, dv]`, beta `[1, Ttot, H]`, cu_seqlens `[N+1]`,
    initial_state `[N, H, dk, dv]` or None. Returns (o `[1, Ttot, H, dv]` in v.dtype, final states `[N, H, dk, dv]`
    float32). dk, dv: powers of two ≥ 16. `tuning`: overrides of `TUNING` (launch shapes, fast_diag, fast_inverse,
    intra_mm, wu_cols, state_bv); `interpret`: Triton's interpreter on the host."""
    tune = _tuning(tuning)
    _, Tt, H, dk = q.shape
    dv = v.shape[-1]
    scale = dk ** -0.5 if scale is None else scale
    tab = M.chunk_table(cu_seqlens, Tt, C)
    N = tab.seq_chunk0.shape[0]
    NCH = tab.n_chunks
    f32 = jnp.float32
    idt = v.dtype if jnp.dtype(v.dtype) != f32 else f32
    a, dtb = _gate_arrays(H, dk, A_log, dt_bias, gate_form)
    rows_mm = _mm_code(idt, "bf16" if tune["intra_mm"] == "bf16_rows" else tune["intra_mm"])
    wu_mm = _mm_code(idt, "tf32" if tune["intra_mm"] == "bf16_rows" else tune["intra_mm"])
    # A1 -> A2 operands (Akk, T_ii, β k e^Γ) in the input dtype when A2 multiplies them in it anyway: Akk and T_ii
    # are only A2's dot operands (same bits); β k e^Γ is rounded once more before A2 subtracts Σ Akk W from it (below
    # the bf16 output's resolution: the same o at T = 8K on the H200). Half the bytes: kernel A 2.26 -> 1.97 ms.
    adt = idt if jnp.dtype(idt) != f32 and wu_mm in (MM_BF16, MM_F16) else f32
    akk, tii, aqk, kg, qg, rk, gl = call(
        tab.start, tab.length, q[0], k[0], g[0], beta[0], a, dtb,
        kernel=_intra_rows_kernel, grid=(NCH, H, C // SUB), interpret=interpret, name="kda_intra_rows",
        out_shape=[jax.ShapeDtypeStruct((Tt, H, C), adt), jax.ShapeDtypeStruct((Tt, H, SUB), adt),
                   jax.ShapeDtypeStruct((Tt, H, C), idt), jax.ShapeDtypeStruct((Tt, H, dk), idt),
                   jax.ShapeDtypeStruct((Tt, H, dk), idt), jax.ShapeDtypeStruct((Tt, H, dk), adt),
                   jax.ShapeDtypeStruct((NCH, H, dk), f32)],
        num_warps=tune["rows_warps"], num_stages=tune["rows_stages"],
        H=H, DK=dk, SCALE=float(scale), GATE=GATE_CODE[gate_form], LOWER=float(lower_bound), MM=rows_mm,
        FAST_DIAG=bool(tune["fast_diag"]), FAST_INVERSE=bool(tune["fast_inverse"]), C=C, SUB=SUB)
    nc = max(1, min(tune["wu_cols"], dk // 16, dv // 16))  # column tiles of ≥ 16 (dk, dv: powers of two)
    if dk % nc or dv % nc:
        raise ValueError(f"wu_cols={nc} must divide dk={dk} and dv={dv}")
    W, U = call(
        tab.start, tab.length, rk, v[0], beta[0], akk, tii,
        kernel=_intra_wu_kernel, grid=(NCH, H, nc), interpret=interpret, name="kda_intra_wu",
        out_shape=[jax.ShapeDtypeStruct((Tt, H, dk), idt), jax.ShapeDtypeStruct((Tt, H, dv), idt)],
        num_warps=tune["wu_warps"], num_stages=tune["wu_stages"],
        H=H, DK=dk, DV=dv, BK=dk // nc, BVW=dv // nc, MM=wu_mm, C=C, SUB=SUB)

    BV = min(tune["state_bv"], dv)
    has_init = initial_state is not None
    s0 = initial_state.astype(f32) if has_init else jnp.zeros((1,), f32)
    o, sf = call(
        tab.seq_chunk0, tab.seq_nchunks, tab.start, tab.length, W, U, kg, qg, aqk, gl, s0,
        kernel=_state_kernel, grid=(dv // BV, H, N), interpret=interpret, name="kda_state",
        out_shape=[jax.ShapeDtypeStruct((Tt, H, dv), v.dtype), jax.ShapeDtypeStruct((N, H, dk, dv), f32)],
        num_warps=tune["state_warps"], num_stages=tune["state_stages"],
        H=H, DK=dk, DV=dv, BV=BV, MM=_mm_code(idt), HAS_INIT=has_init, C=C)
    return o[None], sf


def recurrent(q, k, v, g, beta, state_pool, slot_ids, scale=None, *, A_log=None, dt_bias=None, gate_form=None,
              lower_bound=-5.0, interpret=False, tuning=None):
    """Decode T tokens (T small, unrolled) for B sequences: q, k, g `[B, T, H, dk]`, v `[B, T, H, dv]`, beta
    `[B, T, H]` against `state_pool[slot_ids]` (pool `[S, H, dk, dv]` float32, slot ids `[B]` distinct).
    Returns (o `[B, T, H, dv]` in v.dtype, the pool updated; aliased: donate it under jit for an in-place update)."""
    tune = _tuning(tuning)
    B, T, H, dk = q.shape
    dv = v.shape[-1]
    scale = dk ** -0.5 if scale is None else scale
    BV = min(tune["dec_bv"], dv)
    a, dtb = _gate_arrays(H, dk, A_log, dt_bias, gate_form)
    hp = tune["dec_heads"] if H % tune["dec_heads"] == 0 else 1
    o, pool = call(
        jnp.asarray(slot_ids, jnp.int32), q, k, v, g, beta, a, dtb, state_pool.astype(jnp.float32),
        kernel=_decode_kernel, grid=(B, H // hp, dv // BV), interpret=interpret, name="kda_decode",
        out_shape=[jax.ShapeDtypeStruct((B, T, H, dv), v.dtype), jax.ShapeDtypeStruct(state_pool.shape, jnp.float32)],
        input_output_aliases={8: 1}, num_warps=tune["dec_warps"] or (4 if dk * BV >= 4096 else 2), num_stages=1,
        T=T, H=H, DK=dk, DV=dv, BV=BV, HP=hp, SCALE=float(scale), GATE=GATE_CODE[gate_form],
        LOWER=float(lower_bound))
    return o, pool


def decode_step(x_in, f, b_logit, gate_logit, conv, A_log, dt_bias, o_norm, pools, slot_ids, *, gate_form,
                lower_bound=-5.0, o_norm_eps=1e-6, scale=None, interpret=False, tuning=None):
    """`reference.decode_step` as one kernel, grid (B, H): the conv, norms, gate, delta-rule step and output norm of
    one token per sequence, the slots' states and tails updated in place (aliased: donate the pools under jit).
    dk, dv: powers of two ≥ 16; `gate_form` "lower_bound" or "plain"."""
    tune = _tuning(tuning)
    q_in, k_in, v_in = x_in
    state, q_tail, k_tail, v_tail = pools
    H = A_log.shape[0]
    B, Pv = v_in.shape
    dk, dv = q_in.shape[1] // H, Pv // H
    K = conv[0].shape[0]
    if gate_form not in ("lower_bound", "plain") or K < 2:
        raise ValueError(f"decode_step needs a gate form and a conv of ≥ 2 taps, got {gate_form!r}, K={K}")
    scale = dk ** -0.5 if scale is None else scale
    a, dtb = _gate_arrays(H, dk, A_log, dt_bias, gate_form)
    f32 = jnp.float32
    o, state, q_tail, k_tail, v_tail = call(
        jnp.asarray(slot_ids, jnp.int32), q_in, k_in, v_in, f.astype(f32), b_logit.astype(f32), gate_logit.astype(f32),
        *(w.astype(f32) for w in conv), a, dtb, o_norm.astype(f32), state.astype(f32), q_tail, k_tail, v_tail,
        kernel=_decode_step_kernel, grid=(B, H), interpret=interpret, name="kda_decode_step",
        out_shape=[jax.ShapeDtypeStruct((B, Pv), v_in.dtype), jax.ShapeDtypeStruct(state.shape, f32),
                   *(jax.ShapeDtypeStruct(t.shape, t.dtype) for t in (q_tail, k_tail, v_tail))],
        input_output_aliases={13: 1, 14: 2, 15: 3, 16: 4}, num_warps=tune["dec_warps"] or 4, num_stages=1,
        H=H, DK=dk, DV=dv, K=K, KP=max(2, 1 << (K - 2).bit_length()), SCALE=float(scale),
        GATE=GATE_CODE[gate_form], LOWER=float(lower_bound), EPS=float(o_norm_eps))
    return o, (state, q_tail, k_tail, v_tail)
