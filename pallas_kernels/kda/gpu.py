"""KDA kernels for NVIDIA GPUs (Pallas with the Triton lowering): chunked prefill and slot-addressed decode.

Imports on CPU (jax 0.10.2) and on the GPU host (jax 0.11.2): both expose `jax.experimental.pallas.triton` with
`CompilerParams(num_warps, num_stages)`, `load(ref, mask=, other=)` and `store(ref, val, mask=)`. The Triton backend
is chosen by passing its CompilerParams (jax's default GPU backend is Mosaic GPU). On CPU the kernels run through
`interpret=True`.

Prefill = kernel A (one launch, or two in the default split form below), then kernel B, over the packed [Ttot] token
axis (chunks of 64 aligned to sequence starts):
  A `intra`  grid (chunks, H), fully parallel: Γ, Akk/Aqk with 16-row sub-blocks, (I+Akk)^-1 by blocks,
             W = T(β k e^Γ), U = T(β v), kg = k e^{Γ_last−Γ}, qg = q e^Γ; writes them in the input dtype.
  B `state`  grid (dv/BV, H, sequences), sequential over the sequence's chunks with the state [dk, BV] in registers:
             Vn = U − W S;  O = qg S + Aqk Vn;  S ← e^{Γ_last} S + kgᵀ Vn.
  Variants (`TUNING`, chosen by measurement, bench/kda_gpu_diag.py): `fast_diag` forms a diagonal 16×16 block with
  one matmul around a midpoint reference row when its decay range is ≤ 80 (always for the K3 gate; a run-time
  branch-free select keeps the exact loop otherwise); `fast_inverse` inverts diagonal blocks loop-free
  (chunk_math.unit_lower_inverse); `split_o` moves O out of the serial kernel B into a parallel kernel
  C  grid (chunks, H, dv/BV): B stores the state entering each chunk (h) and Vn, C computes O = qg h + Aqk Vn.
Precision: fp32 inputs use Precision.HIGHEST dots, which the Triton lowering emits as IEEE fp32 (1e-4 bar); bf16
inputs use the default (TF32 in kernel A, bf16 tensor cores with fp32 accumulation in B/C).
Split kernel A (`intra_split`, the default since the 2026-11-30 H200 sweeps): A1 `kda_intra_rows` grid
(chunks, H, 4), one 16-row sub-block per program (Akk/Aqk row, diagonal block, its inverse T_ii, kg, qg; in the
default `rows_form="tiled"` the earlier sub-blocks are visited one [16, dk] tile at a time, gates in base 2 (exp2),
and A1 also writes β k e^Γ; Akk, T_ii and β k e^Γ go to A2 in bf16 for bf16 inputs), then A2 `kda_intra_wu` grid
(chunks, H, wu_cols): W, U by block forward substitution from Akk and T_ii in
memory; products in bf16 (fp32 accumulation) for bf16 inputs (`intra_mm`), IEEE fp32 for fp32 inputs.
Decode = one launch, grid (B, H/dec_heads, dv/BV): the state slice is read from and written back to the pool at the slot id
(aliased, so it is in place under donation); the gate can be computed in-kernel from raw f, A_log and dt_bias.
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

import pallas_kernels.kda.chunk_math as M  # not `from . import`: see kda/ops.py

C = 64
SUB = M.SUB
HP = jax.lax.Precision.HIGHEST
LOG2E = M.LOG2E  # gates in base 2: exp2 is one MUFU.EX2, exp (libdevice expf) about eight instructions
LN2 = 1.0 / LOG2E


# Launch configuration, by measurement on the H200 (bench/kda_gpu_diag.py sweeps these; callers may override per call
# through `tuning=`). intra_*: kernel A; state_*: kernel B; out_*: kernel C (only with split_o); dec_*: decode.
TUNING = dict(
    fast_diag=True,      # diagonal 16×16 blocks by one matmul when the decay range allows (chunk_math.FAST_DIAG_RANGE)
    fast_inverse=True,   # diagonal blocks of (I+Akk)^-1 by chunk_math.unit_lower_inverse instead of substitution
    intra_warps=4, intra_stages=1,
    # kernel B: one pipeline stage keeps its shared memory at 80 KB (144 KB with 2), two programs per SM; H200, 8K:
    # whole op 2.94 vs 2.98 ms (H200)
    state_bv=64, state_warps=4, state_stages=1,
    split_o=False,       # True: kernel B only carries the state (stores it per chunk + Vn); kernel C forms O in parallel
    out_bv=64, out_warps=4, out_stages=2,
    dec_bv=128, dec_warps=4,  # H200 sweep: 233 µs at B = 64 vs 242 µs for BV = 64 (dec_warps=None: 4 if dk·BV ≥ 4096, else 2)
    dec_heads=1,         # heads per decode program (grid (B, H/dec_heads, dv/BV); 1 if it does not divide H)
    intra_only=False,    # diagnostics: `chunk` returns kernel A's outputs (W, U, kg, qg, Aqk, Γ_last) and stops;
                         # "rows": the split A1's outputs only
    # split kernel A (two launches; intra_split=False runs the one-program `kda_intra` instead):
    #   A1 `kda_intra_rows` grid (chunks, H, 4): one 16-row sub-block each — its Akk/Aqk row [16, 64] (see
    #      rows_form), the diagonal block and its inverse T_ii, kg, qg;
    #   A2 `kda_intra_wu` grid (chunks, H, wu_cols): W, U by block forward substitution
    #      W_i = T_ii (βk e^Γ_i − Σ_{m<i} Akk_im W_m) reading Akk and T_ii from memory (no off-diagonal T blocks).
    intra_split=True,    # H200, T = 8K: kernel A 3.49 ms split (full A1) vs 6.80 ms one program per chunk
    intra_mm="bf16",     # split kernel A products for bf16 inputs: "bf16" (tensor cores, fp32 acc.), "tf32", or
                         # "bf16_rows" (bf16 in A1, TF32 in A2);
                         # fp32 inputs always use IEEE fp32 (HIGHEST)
    rows_form="tiled",   # A1's off-diagonal part: "full" (the chunk's k and Γ as [64, dk] values, one [16,dk]×[dk,64]
                         # product) or "tiled" (earlier sub-blocks in a [16, dk] loop, nearest first, with the decay
                         # carried backwards — no [64, dk] value in registers; A1 also writes βk e^Γ so A2 forms no gate)
    wu_form="substitute",  # A2 (tiled rows only): "substitute" (block forward substitution through W_m) or "inverse"
                           # (T's off-diagonal 16×16 blocks first, then independent W_i = Σ_j T_ij βk_j e^Γ_j)
    # A1 holds 255 registers per thread (bench/triton_regs.py; ncu: 12.5% occupancy). An A1 that
    # takes dk in 2–4 column parts (138–168 registers): 2.59–2.79 ms alone against 1.7 ms — the re-reads and
    # recomputation cost more than the occupancy gains — and is not kept. Capping registers through the
    # Triton module attribute `ttg.maxnreg` (A1 at 200 / 168 / 128, A2 at 168 / 128): every cap spilled and was
    # slower, so no cap is applied.
    # H200, T = 8K, H = 96: tiled A1 and A2 at 2 warps each — kernel A 2.29 ms, whole op 2.99 ms (full
    # A1 at 4 + 4 warps: kernel A 3.49–3.82 ms); with base-2 gates, bf16 A1 -> A2 intermediates) kernel A
    # 1.97 ms, whole op 2.63 ms. wu_cols: column tiles of W/U per (chunk, head) (dk/wu_cols wide)
    rows_warps=2, rows_stages=1,
    wu_cols=1, wu_warps=2, wu_stages=1,
)


def _tuning(overrides):
    t = dict(TUNING)
    if overrides:
        unknown = set(overrides) - set(t)
        if unknown:
            raise ValueError(f"unknown KDA GPU tuning keys {sorted(unknown)}")
        t.update(overrides)
    return t


def available() -> bool:
    return pltriton is not None


def _params(num_warps, num_stages=None):
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def prefill_launch(tune) -> dict:
    """(num_warps, num_stages) of each prefill kernel, by its launch name, from a full TUNING dict."""
    state = (tune["state_warps"], tune["state_stages"])
    return dict(kda_intra=(tune["intra_warps"], tune["intra_stages"]),
                kda_intra_rows=(tune["rows_warps"], tune["rows_stages"]),
                kda_intra_wu=(tune["wu_warps"], tune["wu_stages"]),
                kda_state=state, kda_state_only=state,
                kda_out=(tune["out_warps"], tune["out_stages"]))


def _load(ref, mask=None, other=0.0):
    if mask is None:
        return pltriton.load(ref)
    return pltriton.load(ref, mask=mask, other=other)


def _store(ref, val, mask=None):
    if mask is None:
        pltriton.store(ref, val)
    else:
        pltriton.store(ref, val, mask=mask)


def _precision(dtype):
    # fp32 inputs: IEEE fp32 products (1e-4 bar); bf16/fp16 inputs: TF32 tensor cores inside kernel A
    return HP if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


# ------------------------------------------------------------------------------------------------------------------
# prefill kernel A: intra-chunk
# ------------------------------------------------------------------------------------------------------------------

def _intra_kernel(start_ref, len_ref, q_ref, k_ref, v_ref, g_ref, b_ref, a_ref, dtb_ref,
                  w_ref, u_ref, kg_ref, qg_ref, aqk_ref, gl_ref, *, scale, precision, gate_form, lower_bound,
                  fast_diag, fast_inverse):
    j = pl.program_id(0)
    h = pl.program_id(1)
    st = start_ref[j]
    L = len_ref[j]
    dk = q_ref.shape[-1]
    dv = v_ref.shape[-1]
    NS = C // SUB
    r16 = jnp.arange(SUB, dtype=jnp.int32)
    dot = M.make_dot(precision)
    exact_dot = M.make_dot(HP)
    if gate_form is not None:
        a_h = jnp.exp(_load(a_ref.at[h]).astype(jnp.float32))
        dtb = _load(dtb_ref.at[h, :]).astype(jnp.float32)[None, :]

    qb, kb, vb, gb, bb, masks = [], [], [], [], [], []
    for i in range(NS):
        rows = pl.ds(st + i * SUB, SUB)
        valid = (i * SUB + r16) < L
        mk = jnp.broadcast_to(valid[:, None], (SUB, dk))
        mv = jnp.broadcast_to(valid[:, None], (SUB, dv))
        masks.append((valid, mk, mv))
        qb.append(_load(q_ref.at[rows, h, :], mk).astype(jnp.float32) * scale)
        kb.append(_load(k_ref.at[rows, h, :], mk).astype(jnp.float32))
        vb.append(_load(v_ref.at[rows, h, :], mv).astype(jnp.float32))
        g = _load(g_ref.at[rows, h, :], mk).astype(jnp.float32)
        if gate_form is not None:
            g = jnp.where(mk, M.gate_value(g, a_h, dtb, gate_form, lower_bound), 0.0)
        gb.append(g)
        bb.append(_load(b_ref.at[rows, h], valid).astype(jnp.float32)[:, None])

    it = M.intra_chunk(qb, kb, vb, gb, bb, dot=dot, cumsum0=lambda x: jnp.cumsum(x, axis=0), exact_dot=exact_dot,
                       fast_diag=fast_diag, fast_inverse=fast_inverse)
    for i in range(NS):
        rows = pl.ds(st + i * SUB, SUB)
        valid, mk, mv = masks[i]
        _store(w_ref.at[rows, h, :], it.W[i].astype(w_ref.dtype), mk)
        _store(u_ref.at[rows, h, :], it.U[i].astype(u_ref.dtype), mv)
        _store(kg_ref.at[rows, h, :], it.kg[i].astype(kg_ref.dtype), mk)
        _store(qg_ref.at[rows, h, :], it.qg[i].astype(qg_ref.dtype), mk)
        ma = jnp.broadcast_to(valid[:, None], (SUB, SUB))
        for jj in range(NS):
            blk = it.Aqk[i, jj] if jj <= i else jnp.zeros((SUB, SUB), jnp.float32)
            _store(aqk_ref.at[rows, h, pl.ds(jj * SUB, SUB)], blk.astype(aqk_ref.dtype), ma)
    _store(gl_ref.at[j, h, :], it.g_last[0])


# ------------------------------------------------------------------------------------------------------------------
# prefill kernel A, split form (TUNING intra_split): A1 per 16-row sub-block, A2 W/U by block substitution
# ------------------------------------------------------------------------------------------------------------------

def _cast_dot(mm_dtype, precision):
    """float32-accumulating matmul whose operands are cast to mm_dtype first (bf16 tensor cores for bf16 inputs)."""
    def dot(a, b, trans_a=False, trans_b=False):
        ca = 0 if trans_a else 1
        cb = 1 if trans_b else 0
        return jax.lax.dot_general(a.astype(mm_dtype), b.astype(mm_dtype), (((ca,), (cb,)), ((), ())),
                                   precision=precision, preferred_element_type=jnp.float32)
    return dot


def _split_dot(idt, intra_mm, kernel):
    if jnp.dtype(idt) == jnp.float32:
        return _cast_dot(jnp.float32, HP)
    if intra_mm == "bf16_rows":  # bf16 products in A1 (Akk/Aqk), TF32 in A2's substitution chain
        intra_mm = "bf16" if kernel == "rows" else "tf32"
    if intra_mm == "bf16":
        return _cast_dot(idt, jax.lax.Precision.DEFAULT)
    if intra_mm == "tf32":
        return _cast_dot(jnp.float32, jax.lax.Precision.DEFAULT)
    raise ValueError(f"intra_mm must be 'bf16', 'tf32' or 'bf16_rows', got {intra_mm!r}")


def _gate_rows(g, mk, a_ref, dtb_ref, h, gate_form, lower_bound, cols=None):
    if gate_form is None:
        return g
    a_h = jnp.exp(_load(a_ref.at[h]).astype(jnp.float32))
    dtb = _load(dtb_ref.at[h, :] if cols is None else dtb_ref.at[h, cols]).astype(jnp.float32)[None, :]
    return jnp.where(mk, M.gate_value(g, a_h, dtb, gate_form, lower_bound), 0.0)


def _a1_program(start_ref, len_ref):
    """A1's program ids (chunk j, head h, sub-block i) and chunk j's first token and valid length.

    The grid is (chunks, H, C/SUB): Triton runs axis 0 fastest. The order that puts a chunk's four sub-block
    programs side by side (grid (C/SUB, H, chunks)) measured slower on the H200: 2.69 vs 1.74 ms at T = 8K."""
    j = pl.program_id(0)
    return j, pl.program_id(1), pl.program_id(2), start_ref[j], len_ref[j]


def _intra_rows_kernel(start_ref, len_ref, q_ref, k_ref, g_ref, b_ref, a_ref, dtb_ref,
                       akk_ref, tii_ref, aqk_ref, kg_ref, qg_ref, gl_ref, *, scale, dot, gate_form, lower_bound,
                       fast_diag, fast_inverse):
    """A1, grid (chunks, H, C/SUB): sub-block i of chunk j. Stores the β-scaled Akk row [16, C] (columns < 16 i;
    zeros elsewhere), T_ii = (I + Akk_ii)^-1 [16, 16], the Aqk row [16, C], kg_i, qg_i and (i = last) Γ_last."""
    j, h, i, st, L = _a1_program(start_ref, len_ref)
    dk = q_ref.shape[-1]
    NS = C // SUB
    exact_dot = M.make_dot(HP)
    r16 = jnp.arange(SUB, dtype=jnp.int32)
    r64 = jnp.arange(C, dtype=jnp.int32)
    # whole chunk (columns): k, g, Γ
    valid_a = r64 < L
    mka = jnp.broadcast_to(valid_a[:, None], (C, dk))
    rows_a = pl.ds(st, C)
    k_all = _load(k_ref.at[rows_a, h, :], mka).astype(jnp.float32)
    g_all = _gate_rows(_load(g_ref.at[rows_a, h, :], mka).astype(jnp.float32), mka, a_ref, dtb_ref, h, gate_form,
                       lower_bound)
    G_all = jnp.cumsum(g_all, axis=0)
    row_a = jax.lax.broadcasted_iota(jnp.int32, (C, dk), 0)
    before = row_a < i * SUB
    start_i = jnp.sum(jnp.where(before, g_all, 0.0), axis=0, keepdims=True)  # Γ before sub-block i
    g_last = jnp.sum(g_all, axis=0, keepdims=True)
    # this sub-block's rows
    rows = pl.ds(st + i * SUB, SUB)
    valid = (i * SUB + r16) < L
    mk = jnp.broadcast_to(valid[:, None], (SUB, dk))
    qi = _load(q_ref.at[rows, h, :], mk).astype(jnp.float32) * scale
    ki = _load(k_ref.at[rows, h, :], mk).astype(jnp.float32)
    gi = _gate_rows(_load(g_ref.at[rows, h, :], mk).astype(jnp.float32), mk, a_ref, dtb_ref, h, gate_form,
                    lower_bound)
    bi = _load(b_ref.at[rows, h], valid).astype(jnp.float32)[:, None]
    Gi = start_i + jnp.cumsum(gi, axis=0)
    g_end = start_i + jnp.sum(gi, axis=0, keepdims=True)
    # off-diagonal row [16, C]: reference row start_i (every exponent ≤ 0), columns of earlier sub-blocks only
    e_r = jnp.exp(Gi - start_i)
    kc = jnp.where(before, k_all * jnp.exp(jnp.minimum(start_i - G_all, 0.0)), 0.0)
    akk_off = bi * dot(ki * e_r, kc, trans_b=True)
    aqk_off = dot(qi * e_r, kc, trans_b=True)
    # diagonal block and its inverse
    akk_ii, aqk_ii = M.diag_block(Gi, ki, qi, bi, start_i, g_end, dot=dot, fast_diag=fast_diag)
    t_ii = M.diag_inverse(akk_ii, exact_dot, fast_inverse)

    col64 = jax.lax.broadcasted_iota(jnp.int32, (SUB, C), 1)
    vrow = jnp.broadcast_to(valid[:, None], (SUB, C))
    off = col64 < i * SUB
    _store(akk_ref.at[rows, h, :], jnp.where(off, akk_off, 0.0).astype(akk_ref.dtype), vrow)
    # Aqk: off-diagonal/upper columns and the diagonal block by disjoint stores
    _store(aqk_ref.at[rows, h, :], jnp.where(off, aqk_off, 0.0).astype(aqk_ref.dtype),
           vrow & (off | (col64 >= (i + 1) * SUB)))
    m16 = jnp.broadcast_to(valid[:, None], (SUB, SUB))
    _store(aqk_ref.at[rows, h, pl.ds(i * SUB, SUB)], aqk_ii.astype(aqk_ref.dtype), m16)
    _store(tii_ref.at[rows, h, :], t_ii.astype(tii_ref.dtype), m16)
    _store(kg_ref.at[rows, h, :], (ki * jnp.exp(g_last - Gi)).astype(kg_ref.dtype), mk)
    _store(qg_ref.at[rows, h, :], (qi * jnp.exp(Gi)).astype(qg_ref.dtype), mk)
    _store(gl_ref.at[j, h, :], g_last[0], jnp.broadcast_to(i == NS - 1, (dk,)))


def _intra_rows_tiled_kernel(start_ref, len_ref, q_ref, k_ref, g_ref, b_ref, a_ref, dtb_ref,
                             akk_ref, tii_ref, aqk_ref, kg_ref, qg_ref, rk_ref, gl_ref, *, scale, dot, gate_form,
                             lower_bound, fast_diag, fast_inverse):
    """A1 in the `rows_form="tiled"` form, grid (chunks, H, C/SUB): the same outputs as `_intra_rows_kernel` plus
    rk_i = β k_i e^{Γ_i} (A2's right-hand side, float32: A2 subtracts from it), with every value [16, dk] or smaller.

    Earlier sub-blocks m = i−1, …, 0 are visited nearest first, carrying D = Γ(start of i) − Γ(end of m) ≤ 0, so
    that the column factor e^{start_i − Γ_c} = e^{D} · e^{Γ_end(m) − Γ_c} is a product of two factors ≤ 1; after the
    loop D is Γ at the start of sub-block i. Later sub-blocks only contribute their gate sums (to Γ_last).
    Akk/Aqk blocks are stored one [16, 16] column block at a time (Akk's blocks at and above the diagonal are
    never read and are not written)."""
    j, h, i, st, L = _a1_program(start_ref, len_ref)
    dk = q_ref.shape[-1]
    NS = C // SUB
    exact_dot = M.make_dot(HP)
    r16 = jnp.arange(SUB, dtype=jnp.int32)

    def gate_block(m):
        rows = pl.ds(st + m * SUB, SUB)
        mk = jnp.broadcast_to(((m * SUB + r16) < L)[:, None], (SUB, dk))
        g = _gate_rows(_load(g_ref.at[rows, h, :], mk).astype(jnp.float32), mk, a_ref, dtb_ref, h, gate_form,
                       lower_bound)
        return rows, mk, g * LOG2E  # base-2 units: every decay factor below is one exp2 (MUFU.EX2)

    rows, mk, gi = gate_block(i)
    valid = (i * SUB + r16) < L
    m16 = jnp.broadcast_to(valid[:, None], (SUB, SUB))
    qi = _load(q_ref.at[rows, h, :], mk).astype(jnp.float32) * scale
    ki = _load(k_ref.at[rows, h, :], mk).astype(jnp.float32)
    bi = _load(b_ref.at[rows, h], valid).astype(jnp.float32)[:, None]
    cs_i = jnp.cumsum(gi, axis=0)                     # Γ_r − Γ(start of i), ≤ 0
    tot_i = jnp.sum(gi, axis=0, keepdims=True)
    e_r = jnp.exp2(cs_i)
    kr = ki * e_r
    qr = qi * e_r

    def earlier(step, D):
        m = i - 1 - step
        rows_m, mk_m, gm = gate_block(m)
        km = _load(k_ref.at[rows_m, h, :], mk_m).astype(jnp.float32)
        tot_m = jnp.sum(gm, axis=0, keepdims=True)
        kc = km * jnp.exp2(D + (tot_m - jnp.cumsum(gm, axis=0)))  # e^{start_i − Γ_c}, both factors ≤ 1
        cols = pl.ds(m * SUB, SUB)
        _store(akk_ref.at[rows, h, cols], (bi * dot(kr, kc, trans_b=True)).astype(akk_ref.dtype), m16)
        _store(aqk_ref.at[rows, h, cols], dot(qr, kc, trans_b=True).astype(aqk_ref.dtype), m16)
        return D + tot_m

    zero_row = jnp.zeros((1, dk), jnp.float32)
    start_i = jax.lax.fori_loop(0, i, earlier, zero_row)
    after_i = jax.lax.fori_loop(0, NS - 1 - i, lambda step, acc: acc + jnp.sum(gate_block(i + 1 + step)[2], axis=0,
                                                                                keepdims=True), zero_row)
    # diagonal block (only differences of Γ enter it) and its inverse
    akk_ii, aqk_ii = M.diag_block(cs_i, ki, qi, bi, zero_row, tot_i, dot=dot, fast_diag=fast_diag, base2=True)
    t_ii = M.diag_inverse(akk_ii, exact_dot, fast_inverse)
    _store(aqk_ref.at[rows, h, pl.ds(i * SUB, SUB)], aqk_ii.astype(aqk_ref.dtype), m16)
    zeros16 = jnp.zeros((SUB, SUB), aqk_ref.dtype)
    for jj in range(1, NS):  # Aqk above the diagonal (kernel B reads whole rows)
        _store(aqk_ref.at[rows, h, pl.ds(jj * SUB, SUB)], zeros16, m16 & (jj > i))
    _store(tii_ref.at[rows, h, :], t_ii.astype(tii_ref.dtype), m16)
    e_G = jnp.exp2(start_i + cs_i)  # e^{Γ_i}
    _store(kg_ref.at[rows, h, :], (ki * jnp.exp2((tot_i - cs_i) + after_i)).astype(kg_ref.dtype), mk)
    _store(qg_ref.at[rows, h, :], (qi * e_G).astype(qg_ref.dtype), mk)
    _store(rk_ref.at[rows, h, :], (bi * ki * e_G).astype(rk_ref.dtype), mk)
    _store(gl_ref.at[j, h, :], (start_i + tot_i)[0] * LN2, jnp.broadcast_to(i == NS - 1, (dk,)))


def _intra_wu_kernel(start_ref, len_ref, x_ref, v_ref, g_ref, b_ref, a_ref, dtb_ref, akk_ref, tii_ref,
                     w_ref, u_ref, *, dot, gate_form, lower_bound, BK, BVw, rhs, inverse):
    """A2, grid (chunks, H, wu_cols): W = T (β k e^Γ), U = T (β v), T = (I + Akk)^-1, on a column tile of width
    BK (W) / BVw (U).

    rhs: "gate" — x_ref is k and β k e^Γ is formed here from the raw gate (after the whole-chunk A1); "stored" —
    x_ref holds β k e^Γ in float32 (the tiled A1 writes it).
    inverse=False: block forward substitution W_i = T_ii (rhs_i − Σ_{m<i} Akk_im W_m), reading Akk and T_ii as it
    goes; True (`wu_form="inverse"`): T's off-diagonal 16×16 blocks first (`chunk_math.inverse_offdiag`, IEEE fp32
    products — only [16, 16] blocks chain), then the independent products W_i = Σ_{j≤i} T_ij rhs_j."""
    j = pl.program_id(0)
    h = pl.program_id(1)
    p = pl.program_id(2)
    kc = pl.ds(p * BK, BK)
    vc = pl.ds(p * BVw, BVw)
    st = start_ref[j]
    L = len_ref[j]
    NS = C // SUB
    r16 = jnp.arange(SUB, dtype=jnp.int32)
    s = jnp.zeros((1, BK), jnp.float32)
    rows, mk, mv, rk, rv, W, U, A, T = [], [], [], [], [], [], [], {}, {}
    for i in range(NS):
        rows.append(pl.ds(st + i * SUB, SUB))
        valid = (i * SUB + r16) < L
        mk.append(jnp.broadcast_to(valid[:, None], (SUB, BK)))
        mv.append(jnp.broadcast_to(valid[:, None], (SUB, BVw)))
        m16 = jnp.broadcast_to(valid[:, None], (SUB, SUB))
        bi = _load(b_ref.at[rows[i], h], valid).astype(jnp.float32)[:, None]
        if rhs == "gate":
            g = _gate_rows(_load(g_ref.at[rows[i], h, kc], mk[i]).astype(jnp.float32), mk[i], a_ref, dtb_ref, h,
                           gate_form, lower_bound, cols=kc)
            Gi = s + jnp.cumsum(g, axis=0)
            s = s + jnp.sum(g, axis=0, keepdims=True)
            rk.append(bi * _load(x_ref.at[rows[i], h, kc], mk[i]).astype(jnp.float32) * jnp.exp(Gi))
        else:
            rk.append(_load(x_ref.at[rows[i], h, kc], mk[i]).astype(jnp.float32))
        rv.append(bi * _load(v_ref.at[rows[i], h, vc], mv[i]).astype(jnp.float32))
        for m in range(i):
            A[i, m] = _load(akk_ref.at[rows[i], h, pl.ds(m * SUB, SUB)], m16)
            if not inverse:
                rk[i] = rk[i] - dot(A[i, m], W[m])
                rv[i] = rv[i] - dot(A[i, m], U[m])
        T[i, i] = _load(tii_ref.at[rows[i], h, :], m16)
        if not inverse:
            W.append(dot(T[i, i], rk[i]))
            U.append(dot(T[i, i], rv[i]))
    if inverse:
        M.inverse_offdiag(A, T, NS, M.make_dot(HP))
        W = M.apply_lower_blocks(T, rk, dot)
        U = M.apply_lower_blocks(T, rv, dot)
    for i in range(NS):
        _store(w_ref.at[rows[i], h, kc], W[i].astype(w_ref.dtype), mk[i])
        _store(u_ref.at[rows[i], h, vc], U[i].astype(u_ref.dtype), mv[i])


def _intra_split(tab, q, k, v, g, beta, a, dtb, *, scale, idt, tune, gate_form, lower_bound, interpret):
    """The split kernel A: A1 (`rows_form` "full" or "tiled") then A2 (`wu_form` "substitute" or "inverse")."""
    Tt, H, dk = q.shape
    dv = v.shape[-1]
    NCH = tab.n_chunks
    if tune["rows_form"] not in ("full", "tiled"):
        raise ValueError(f"rows_form must be 'full' or 'tiled', got {tune['rows_form']!r}")
    if tune["wu_form"] not in ("substitute", "inverse"):
        raise ValueError(f"wu_form must be 'substitute' or 'inverse', got {tune['wu_form']!r}")
    tiled = tune["rows_form"] == "tiled"
    if tune["wu_form"] == "inverse" and not tiled:
        raise ValueError("wu_form='inverse' needs rows_form='tiled' (it reads A1's β k e^Γ)")
    nc = max(1, min(tune["wu_cols"], dk // 16, dv // 16))  # tiles of ≥ 16 columns (dk, dv: powers of two)
    if dk % nc or dv % nc:
        raise ValueError(f"wu_cols={nc} must divide dk={dk} and dv={dv}")
    f32 = jnp.float32
    # A1 -> A2 intermediates in the input dtype when A2 runs bf16 products by substitution: Akk and T_ii are only
    # A2's dot operands, which it casts to bf16 anyway (same bits); β k e^Γ is rounded once more before A2 subtracts
    # Σ Akk W from it (the difference is below the bf16 output's resolution: same o at T = 8K on the H200). Half the
    # bytes: kernel A 2.26 -> 1.97 ms at T = 8K. The inverse form and TF32 / IEEE products keep float32.
    adt = (idt if jnp.dtype(idt) != f32 and tune["intra_mm"] == "bf16" and tune["wu_form"] == "substitute"
           else f32)
    out_rows = ([jax.ShapeDtypeStruct((Tt, H, C), adt), jax.ShapeDtypeStruct((Tt, H, SUB), adt),
                 jax.ShapeDtypeStruct((Tt, H, C), idt), jax.ShapeDtypeStruct((Tt, H, dk), idt),
                 jax.ShapeDtypeStruct((Tt, H, dk), idt)]
                + ([jax.ShapeDtypeStruct((Tt, H, dk), adt)] if tiled else [])  # β k e^Γ for A2
                + [jax.ShapeDtypeStruct((NCH, H, dk), f32)])
    outs = pl.pallas_call(
        functools.partial(_intra_rows_tiled_kernel if tiled else _intra_rows_kernel, scale=scale,
                          dot=_split_dot(idt, tune["intra_mm"], "rows"), gate_form=gate_form,
                          lower_bound=lower_bound, fast_diag=tune["fast_diag"], fast_inverse=tune["fast_inverse"]),
        grid=(NCH, H, C // SUB),
        out_shape=out_rows,
        compiler_params=_params(*prefill_launch(tune)["kda_intra_rows"]),
        interpret=interpret,
        name="kda_intra_rows",
    )(tab.start, tab.length, q, k, g, beta, a, dtb)
    if tune["intra_only"] == "rows":
        return tuple(outs)
    akk, tii, aqk, kg, qg = outs[:5]
    gl = outs[-1]
    W, U = pl.pallas_call(
        functools.partial(_intra_wu_kernel, dot=_split_dot(idt, tune["intra_mm"], "wu"), gate_form=gate_form,
                          lower_bound=lower_bound, BK=dk // nc, BVw=dv // nc, rhs="stored" if tiled else "gate",
                          inverse=tune["wu_form"] == "inverse"),
        grid=(NCH, H, nc),
        out_shape=[jax.ShapeDtypeStruct((Tt, H, dk), idt), jax.ShapeDtypeStruct((Tt, H, dv), idt)],
        compiler_params=_params(*prefill_launch(tune)["kda_intra_wu"]),
        interpret=interpret,
        name="kda_intra_wu",
    )(tab.start, tab.length, outs[5] if tiled else k, v, g, beta, a, dtb, akk, tii)
    return W, U, kg, qg, aqk, gl


# ------------------------------------------------------------------------------------------------------------------
# prefill kernel B: state recurrence over chunks (+ output)
# ------------------------------------------------------------------------------------------------------------------

def _state_kernel(chunk0_ref, nch_ref, start_ref, len_ref, w_ref, u_ref, kg_ref, qg_ref, aqk_ref, gl_ref, s0_ref,
                  o_ref, sf_ref, *, BV, precision, mm_dtype, has_init):
    """Kernel B, grid (dv/BV, H, N): the serial state chain over sequence n's chunks, with the output. Per chunk:
    Vn = U − W S, O = qg S + Aqk Vn, S ← e^{Γ_last} S + kgᵀ Vn. (Loading chunk c+1's tiles before chunk c's
    products, carried through the loop, measured slower on the H200: 3.27 vs 2.98 ms for the whole op at 8K.)"""
    vb = pl.program_id(0)
    h = pl.program_id(1)
    n = pl.program_id(2)
    dk = w_ref.shape[-1]
    cols = pl.ds(vb * BV, BV)
    c0 = chunk0_ref[n]
    nc = nch_ref[n]
    r64 = jnp.arange(C, dtype=jnp.int32)
    dot = M.make_dot(precision)
    if has_init:
        S = _load(s0_ref.at[n, h, :, cols]).astype(jnp.float32)
    else:
        S = jnp.zeros((dk, BV), jnp.float32)

    def body(c, S):
        j = c0 + c
        st = start_ref[j]
        valid = r64 < len_ref[j]
        rows = pl.ds(st, C)
        mk = jnp.broadcast_to(valid[:, None], (C, dk))
        mv = jnp.broadcast_to(valid[:, None], (C, BV))
        ma = jnp.broadcast_to(valid[:, None], (C, C))
        W = _load(w_ref.at[rows, h, :], mk).astype(mm_dtype)
        U = _load(u_ref.at[rows, h, cols], mv).astype(jnp.float32)
        kg = _load(kg_ref.at[rows, h, :], mk).astype(mm_dtype)
        qg = _load(qg_ref.at[rows, h, :], mk).astype(mm_dtype)
        A = _load(aqk_ref.at[rows, h, :], ma).astype(mm_dtype)
        gl = _load(gl_ref.at[j, h, :]).astype(jnp.float32)
        Sm = S.astype(mm_dtype)
        Vn = U - dot(W, Sm)
        Vm = Vn.astype(mm_dtype)
        O = dot(qg, Sm) + dot(A, Vm)
        _store(o_ref.at[rows, h, cols], O.astype(o_ref.dtype), mv)
        return S * jnp.exp(gl)[:, None] + dot(kg, Vm, trans_a=True)

    S = jax.lax.fori_loop(0, nc, body, S)
    _store(sf_ref.at[n, h, :, cols], S)


def _state_only_kernel(chunk0_ref, nch_ref, start_ref, len_ref, w_ref, u_ref, kg_ref, gl_ref, s0_ref,
                       h_ref, vn_ref, sf_ref, *, BV, precision, mm_dtype, has_init):
    """Kernel B of the split form: only the serial state chain. Per chunk j it stores the state entering the chunk
    (h [NCH, H, dk, dv] in mm_dtype) and Vn = U − W S ([Ttot, H, dv]); kernel C forms O from them in parallel."""
    vb = pl.program_id(0)
    h = pl.program_id(1)
    n = pl.program_id(2)
    dk = w_ref.shape[-1]
    cols = pl.ds(vb * BV, BV)
    c0 = chunk0_ref[n]
    nc = nch_ref[n]
    r64 = jnp.arange(C, dtype=jnp.int32)
    dot = M.make_dot(precision)
    if has_init:
        S = _load(s0_ref.at[n, h, :, cols]).astype(jnp.float32)
    else:
        S = jnp.zeros((dk, BV), jnp.float32)

    def body(c, S):
        j = c0 + c
        st = start_ref[j]
        valid = r64 < len_ref[j]
        rows = pl.ds(st, C)
        mk = jnp.broadcast_to(valid[:, None], (C, dk))
        mv = jnp.broadcast_to(valid[:, None], (C, BV))
        W = _load(w_ref.at[rows, h, :], mk).astype(mm_dtype)
        U = _load(u_ref.at[rows, h, cols], mv).astype(jnp.float32)
        kg = _load(kg_ref.at[rows, h, :], mk).astype(mm_dtype)
        gl = _load(gl_ref.at[j, h, :]).astype(jnp.float32)
        Sm = S.astype(mm_dtype)
        _store(h_ref.at[j, h, :, cols], Sm.astype(h_ref.dtype))
        Vm = (U - dot(W, Sm)).astype(mm_dtype)
        _store(vn_ref.at[rows, h, cols], Vm.astype(vn_ref.dtype), mv)
        return S * jnp.exp(gl)[:, None] + dot(kg, Vm, trans_a=True)

    S = jax.lax.fori_loop(0, nc, body, S)
    _store(sf_ref.at[n, h, :, cols], S)


def _out_kernel(start_ref, len_ref, qg_ref, aqk_ref, vn_ref, h_ref, o_ref, *, BV, precision, mm_dtype):
    """Kernel C of the split form, grid (chunks, H, dv/BV), fully parallel: O = qg S_j + Aqk Vn."""
    j = pl.program_id(0)
    h = pl.program_id(1)
    cols = pl.ds(pl.program_id(2) * BV, BV)
    dk = qg_ref.shape[-1]
    st = start_ref[j]
    valid = jnp.arange(C, dtype=jnp.int32) < len_ref[j]
    rows = pl.ds(st, C)
    mk = jnp.broadcast_to(valid[:, None], (C, dk))
    mv = jnp.broadcast_to(valid[:, None], (C, BV))
    ma = jnp.broadcast_to(valid[:, None], (C, C))
    dot = M.make_dot(precision)
    qg = _load(qg_ref.at[rows, h, :], mk).astype(mm_dtype)
    A = _load(aqk_ref.at[rows, h, :], ma).astype(mm_dtype)
    Vn = _load(vn_ref.at[rows, h, cols], mv).astype(mm_dtype)
    Sm = _load(h_ref.at[j, h, :, cols]).astype(mm_dtype)
    O = dot(qg, Sm) + dot(A, Vn)
    _store(o_ref.at[rows, h, cols], O.astype(o_ref.dtype), mv)


def chunk(q, k, v, g, beta, cu_seqlens, initial_state=None, scale=None, *, A_log=None, dt_bias=None,
          gate_form=None, lower_bound=-5.0, interpret=False, tuning=None):
    """Packed prefill on GPU. q, k, g `[1, Ttot, H, dk]`, v `[1, Ttot, H, dv]`, beta `[1, Ttot, H]`.

    With `gate_form` set, `g` is the raw forget projection f and the gate is computed inside kernel A.
    Returns (o `[1, Ttot, H, dv]` in v.dtype, final states `[N, H, dk, dv]` float32). dk, dv: powers of two ≥ 16.
    `tuning`: overrides of `TUNING` (launch shapes, split_o, fast_diag).
    """
    tune = _tuning(tuning)
    _, Tt, H, dk = q.shape
    dv = v.shape[-1]
    scale = dk ** -0.5 if scale is None else scale
    tab = M.chunk_table(cu_seqlens, Tt, C)
    N = tab.seq_chunk0.shape[0]
    NCH = tab.n_chunks
    idt = v.dtype if jnp.dtype(v.dtype) != jnp.float32 else jnp.float32
    prec = _precision(idt)
    if gate_form is None:
        a = jnp.zeros((H,), jnp.float32)
        dtb = jnp.zeros((H, dk), jnp.float32)
    else:
        a = jnp.asarray(A_log, jnp.float32).reshape(H)
        dtb = jnp.asarray(dt_bias, jnp.float32).reshape(H, dk)
    out_a = [jax.ShapeDtypeStruct((Tt, H, dk), idt), jax.ShapeDtypeStruct((Tt, H, dv), idt),
             jax.ShapeDtypeStruct((Tt, H, dk), idt), jax.ShapeDtypeStruct((Tt, H, dk), idt),
             jax.ShapeDtypeStruct((Tt, H, C), idt), jax.ShapeDtypeStruct((NCH, H, dk), jnp.float32)]
    if tune["intra_split"]:
        outs = _intra_split(tab, q[0], k[0], v[0], g[0], beta[0], a, dtb, scale=scale, idt=idt, tune=tune,
                            gate_form=gate_form, lower_bound=lower_bound, interpret=interpret)
        if tune["intra_only"] == "rows":  # diagnostics: A1's outputs (6 or 7 arrays by rows_form)
            return outs
        W, U, kg, qg, Aqk, gl = outs
    else:
        W, U, kg, qg, Aqk, gl = pl.pallas_call(
            functools.partial(_intra_kernel, scale=scale, precision=prec, gate_form=gate_form, lower_bound=lower_bound,
                              fast_diag=tune["fast_diag"], fast_inverse=tune["fast_inverse"]),
            grid=(NCH, H),
            out_shape=out_a,
            compiler_params=_params(*prefill_launch(tune)["kda_intra"]),
            interpret=interpret,
            name="kda_intra",
        )(tab.start, tab.length, q[0], k[0], v[0], g[0], beta[0], a, dtb)
    if tune["intra_only"]:
        return W, U, kg, qg, Aqk, gl

    BV = min(tune["state_bv"], dv)
    has_init = initial_state is not None
    s0 = initial_state.astype(jnp.float32) if has_init else jnp.zeros((1, 1, 1, 1), jnp.float32)
    state_params = _params(*prefill_launch(tune)["kda_state"])
    if not tune["split_o"]:
        o, sf = pl.pallas_call(
            functools.partial(_state_kernel, BV=BV, precision=prec, mm_dtype=idt, has_init=has_init),
            grid=(dv // BV, H, N),
            out_shape=[jax.ShapeDtypeStruct((Tt, H, dv), v.dtype),
                       jax.ShapeDtypeStruct((N, H, dk, dv), jnp.float32)],
            compiler_params=state_params,
            interpret=interpret,
            name="kda_state",
        )(tab.seq_chunk0, tab.seq_nchunks, tab.start, tab.length, W, U, kg, qg, Aqk, gl, s0)
        return o[None], sf
    # split form: B carries the state only; C (parallel over chunks) forms the output
    hs, vn, sf = pl.pallas_call(
        functools.partial(_state_only_kernel, BV=BV, precision=prec, mm_dtype=idt, has_init=has_init),
        grid=(dv // BV, H, N),
        out_shape=[jax.ShapeDtypeStruct((NCH, H, dk, dv), idt), jax.ShapeDtypeStruct((Tt, H, dv), idt),
                   jax.ShapeDtypeStruct((N, H, dk, dv), jnp.float32)],
        compiler_params=state_params,
        interpret=interpret,
        name="kda_state_only",
    )(tab.seq_chunk0, tab.seq_nchunks, tab.start, tab.length, W, U, kg, gl, s0)
    BVo = min(tune["out_bv"], dv)
    o = pl.pallas_call(
        functools.partial(_out_kernel, BV=BVo, precision=prec, mm_dtype=idt),
        grid=(NCH, H, dv // BVo),
        out_shape=jax.ShapeDtypeStruct((Tt, H, dv), v.dtype),
        compiler_params=_params(*prefill_launch(tune)["kda_out"]),
        interpret=interpret,
        name="kda_out",
    )(tab.start, tab.length, qg, Aqk, vn, hs)
    return o[None], sf


# ------------------------------------------------------------------------------------------------------------------
# decode
# ------------------------------------------------------------------------------------------------------------------

def _decode_kernel(slot_ref, q_ref, k_ref, v_ref, g_ref, b_ref, a_ref, dtb_ref, pool_ref, o_ref, pool_out_ref, *,
                   BV, scale, n_steps, gate_form, lower_bound, HP_=1):
    for hh in range(HP_):  # dec_heads: heads per program (static), each an independent [dk, BV] state tile
        _decode_head(pl.program_id(1) * HP_ + hh, slot_ref, q_ref, k_ref, v_ref, g_ref, b_ref, a_ref, dtb_ref,
                     pool_ref, o_ref, pool_out_ref, BV=BV, scale=scale, n_steps=n_steps, gate_form=gate_form,
                     lower_bound=lower_bound)


def _decode_head(h, slot_ref, q_ref, k_ref, v_ref, g_ref, b_ref, a_ref, dtb_ref, pool_ref, o_ref, pool_out_ref, *,
                 BV, scale, n_steps, gate_form, lower_bound):
    b = pl.program_id(0)
    cols = pl.ds(pl.program_id(2) * BV, BV)
    slot = slot_ref[b]
    S = _load(pool_ref.at[slot, h, :, cols])
    if gate_form is not None:
        a_h = jnp.exp(_load(a_ref.at[h]).astype(jnp.float32))
        dtb = _load(dtb_ref.at[h, :]).astype(jnp.float32)
    for t_static in range(n_steps):
        t = jnp.int32(t_static)  # a traced index (interpret mode's discharge rule wants one)
        q = _load(q_ref.at[b, t, h, :]).astype(jnp.float32) * scale
        k = _load(k_ref.at[b, t, h, :]).astype(jnp.float32)
        v = _load(v_ref.at[b, t, h, cols]).astype(jnp.float32)
        g = _load(g_ref.at[b, t, h, :]).astype(jnp.float32)
        if gate_form is not None:
            g = M.gate_value(g, a_h, dtb, gate_form, lower_bound)
        beta = _load(b_ref.at[b, t, h]).astype(jnp.float32)
        S = S * jnp.exp(g)[:, None]
        kS = jnp.sum(k[:, None] * S, axis=0)
        S = S + k[:, None] * (beta * (v - kS))[None, :]
        _store(o_ref.at[b, t, h, cols], jnp.sum(q[:, None] * S, axis=0).astype(o_ref.dtype))
    _store(pool_out_ref.at[slot, h, :, cols], S)


def recurrent(q, k, v, g, beta, state_pool, slot_ids, scale=None, *, A_log=None, dt_bias=None, gate_form=None,
              lower_bound=-5.0, interpret=False, tuning=None):
    """Decode T tokens (T small, unrolled) for B sequences against `state_pool[slot_ids]` `[S, H, dk, dv]` fp32.

    The pool is aliased to the second output: donate it under jit for an in-place update.
    """
    tune = _tuning(tuning)
    block_v = tune["dec_bv"]
    B, T, H, dk = q.shape
    dv = v.shape[-1]
    scale = dk ** -0.5 if scale is None else scale
    BV = min(block_v, dv)
    if gate_form is None:
        a = jnp.zeros((H,), jnp.float32)
        dtb = jnp.zeros((H, dk), jnp.float32)
    else:
        a = jnp.asarray(A_log, jnp.float32).reshape(H)
        dtb = jnp.asarray(dt_bias, jnp.float32).reshape(H, dk)
    hp = tune["dec_heads"] if H % tune["dec_heads"] == 0 else 1
    o, pool = pl.pallas_call(
        functools.partial(_decode_kernel, BV=BV, scale=scale, n_steps=T, gate_form=gate_form,
                          lower_bound=lower_bound, HP_=hp),
        grid=(B, H // hp, dv // BV),
        out_shape=[jax.ShapeDtypeStruct((B, T, H, dv), v.dtype),
                   jax.ShapeDtypeStruct(state_pool.shape, jnp.float32)],
        input_output_aliases={8: 1},
        compiler_params=_params(num_warps=tune["dec_warps"] or (4 if dk * BV >= 4096 else 2), num_stages=1),
        interpret=interpret,
        name="kda_decode",
    )(slot_ids.astype(jnp.int32), q, k, v, g, beta, a, dtb, state_pool.astype(jnp.float32))
    return o, pool
