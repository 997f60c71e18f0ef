"""Native Triton GPU kernel (launched through jax-triton; CPU tests: Triton's interpreter): DSA indexer decode scores
over a sequence's paged index keys.

    score[b, s] = Σ_h w[b,h] · relu(q[b,h]·k[b,s])   for s ≤ pos[b], −inf after (and for pos[b] < 0)

The reference is `reference.scores` over `fmt.dequantize(gather_pages(...))` (what `paged.topk_indices(...,
backend="reference")` scores). Top-k is not in the kernel: `paged.select_topk` runs over the score row it writes.

Grid (B, n_prog): program (b, j) walks `n_inner` chunks of BN consecutive positions of sequence b (n_inner from
`tokens_per_program`, by default ≈ 4 programs per SM). Chunks wholly past the query position are not read, only
written −inf (dynamic trip counts: a short sequence in a wide table costs its own keys only). Per live chunk it maps
positions through the block table to pool rows (block ids clamped into the pool), gathers the BN stored keys `[BN, w]`
from each part, dequantises in registers and scores all Hi heads with tensor-core dots ("kq": keys [BN, d] · qᵀ ->
[BN, Hi], the default; "qk": q · keysᵀ -> [Hi, BN]).

Formats (the parts of `kimi_jax.quant.IndexKeyFormat`):
- "fp8": e4m3 codes `[d]` + one fp32 scale per token (d ≤ 128: one scale group; K3.1 and DeepSeek-V3.2 have
  d = 128, `fits` says so and "auto" falls back to the reference otherwise). The dot runs on the codes (exact in
  f16 and bf16) and the scale multiplies it before the relu.
- "mxfp4": packed e2m1 `[d/2]` (byte j = elements 2j (low nibble), 2j + 1 (high)) + E8M0 `[d/32]` (byte j is in
  group j // 16). Values are e2m1 · 2^(e−127) (exact in bf16); q's columns are permuted outside into [even | odd] so
  the two nibble planes are dotted separately (no interleave in registers). E8M0 byte 0 (2^-127) decodes to 0.
- "bf16": bf16 keys.
Precision: keys are exact in the dot dtype (f16 for fp8 keys, bf16 otherwise). Each head's q is divided by a power
of two ≥ its max |q| (folded into w: relu(q·k)·w = relu((q/s)·k)·(w·s), exact) and split into hi + lo in cdt
(`gpu_prep.split_hi_lo`: integer-mask truncation, which XLA cannot fold away — the plain f32(cdt(q)) round trip is
removed by XLA on GPU, which left q at cdt precision on the H200); two dots (hi, lo) accumulate in fp32: q·k to
≈ 2^-21 (f16) / 2^-15 (bf16) relative. `exact=False` keeps only hi; with `dot_dtype="fp8"` the stored codes go to
the fp8 tensor cores as they are, against q as two e4m3 planes.
Address safety: pool rows are int64 before they are multiplied by the row width (pools past 2^31 bytes need
nothing special), positions are ≥ 0, table reads clamped to the row and block ids to [0, num_blocks).
Constraints (Triton blocks are powers of two): Hi (padded to ≥ 16 here), BN, and the loaded key widths (d, or d/2
for mxfp4). K3.1: Hi = 32, d = 128.
Portability: plain `tl` operations only (no inline PTX), so the kernel compiles for ROCm too; its fp8 dot needs OCP
e4m3 tensor-core support (Hopper, Ada; AMD MI350 — not MI300, whose fp8 is e4m3fnuz), see docs/gpu.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..gpu_prep import MIN_DOT, is_pow2, pow2_scale, split_hi_lo
from ..triton_call import available as _launcher_available
from ..triton_call import call, jit, tl
from ..triton_codec import e2m1_value, e8m0_value, pow2_at_least

__all__ = ["FAST", "available", "fits", "pow2_scale", "scores", "storage_preset", "supports"]

SUPPORTED = ("fp8", "mxfp4", "bf16")
FP8_GROUP = 128
FMT_CODE = {"fp8": 0, "mxfp4": 1, "bf16": 2}
CDT_CODE = {jnp.dtype(jnp.float16): 0, jnp.dtype(jnp.bfloat16): 1, jnp.dtype(jnp.float8_e4m3fn): 2}


def available() -> bool:
    return _launcher_available()


def supports(fmt) -> bool:
    return getattr(fmt, "index_dtype", None) in SUPPORTED


def fits(fmt, heads: int, dim: int) -> bool:
    """Whether the kernel compiles for these shapes: power-of-two key widths (d, or d/2 for mxfp4) of at least 16
    (tensor-core dots), and d ≤ 128 for fp8 keys (one scale group per token). Any head count (padded to ≥ 16)."""
    kind = getattr(fmt, "index_dtype", None)
    width = dim // 2 if kind == "mxfp4" else dim
    return (supports(fmt) and heads >= 1 and is_pow2(width) and width >= MIN_DOT
            and (kind != "fp8" or dim <= FP8_GROUP))


def padded_heads(Hi: int) -> int:
    """The kernel's head count: a power of two ≥ MIN_DOT (16). Every tensor-core dot dimension must be ≥ 16 — Hi is
    the M side of the "qk" dot and the N side of the "kq" one; on the H200 the tiny model's 8 heads gave wrong
    scores."""
    return max(MIN_DOT, 1 << (Hi - 1).bit_length())


FP8_DOT_K = 32  # an fp8 tensor-core instruction's contraction depth: fp8 dots need d to be a multiple of it
FP8_Q_RANGE = 256.0  # dot_dtype "fp8": each head's q scaled to |x| < 256 (e4m3: max 448, normal from 2^-6)


def _dot_dtype(fmt, dot_dtype: str):
    """The tensor-core operand dtype: f16 where the stored keys are exact in it (fp8 e4m3: 4-bit exponent; the
    cheap native e4m3 -> f16 conversion on sm_89+, and 11-bit mantissa for q), bf16 otherwise (bf16 keys; mxfp4,
    whose E8M0 scales reach outside f16's range). "fp8" (fp8 keys with q prepared in the kernel, i.e. q_inside and
    single-pass, and d a multiple of FP8_DOT_K; `scores` falls back to "auto" otherwise): the stored codes go to the
    tensor cores as they are — no conversion — against q as two e4m3 planes hi + lo (≈ 2^-8 relative; 6e-4
    relative RMS on the H200 at K3 shapes)."""
    if dot_dtype == "auto":
        dot_dtype = "f16" if fmt.index_dtype == "fp8" else "bf16"
    if dot_dtype not in ("f16", "bf16", "fp8"):
        raise ValueError(f"dot_dtype must be 'auto', 'f16', 'bf16' or 'fp8', got {dot_dtype!r}")
    if dot_dtype == "f16" and fmt.index_dtype != "fp8":
        raise ValueError(f"dot_dtype {dot_dtype} is exact only for fp8 keys, not {fmt.index_dtype}")
    return {"f16": jnp.float16, "bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn}[dot_dtype]


def _prep_q(q_bhd, w_bh, fmt, exact: bool, cdt):
    """q `[B, Hi, d]`, w `[B, Hi]` -> (q `[B, P, Hi, d]` in cdt (P = 2 planes hi | lo, or 1), w' `[B, Hi]` f32).
    Each head's q is divided by a power of two s_h ≥ max|q_h| and s_h is folded into w (relu commutes with
    s_h > 0, and scaling by 2^e is exact), so the hi/lo halves sit well inside f16's range."""
    q = q_bhd.astype(jnp.float32)
    s = pow2_scale(q)  # [B, Hi, 1]
    q = q / s
    w = w_bh.astype(jnp.float32) * s[..., 0]
    if fmt.index_dtype == "mxfp4":
        q = jnp.concatenate([q[..., 0::2], q[..., 1::2]], axis=-1)
    if not exact:
        return q.astype(cdt)[:, None], w
    hi, lo = split_hi_lo(q, cdt)  # integer-mask split: XLA on GPU folds `q - f32(cdt(q))` to 0 (see split_hi_lo)
    return jnp.stack([hi, lo], axis=1), w


def _auto_tokens_per_program(B: int, n_chunks: int, BN: int, target_programs: int = 4 * 132,
                             lo: int = 512, hi: int = 8192) -> int:
    """Tokens per program so that B · programs ≈ 4 per SM (H200: 132 SMs), within [lo, hi] tokens."""
    S = n_chunks * BN
    tpp = hi
    while tpp > max(lo, BN) and B * -(-S // tpp) < target_programs:
        tpp //= 2
    return max(BN, tpp)


# Opt-in presets (not the model's default): single-pass products (exact=False: q in the dot dtype only, no lo
# half — f16 q for fp8 keys, bf16 q for mxfp4 keys) and larger key tiles. Selection rule for them: the selected set
# equals the reference's on untied scores; a key may differ from the reference selection only when its reference
# score lies within 2·E of the k-th score, E = the measured max |score error| (a numerical near-tie; tests and
# bench check exactly this). The bench sweeps them against the default. The timings and ptxas figures (registers /
# shared memory) below were measured on the Pallas Triton kernel this one replaced (issue #48), with the same knobs;
# docs/performance.md has the native kernel's.
FAST = {
    "sp128": dict(exact=False, block_n=128, num_warps=4, num_stages=3),
    "sp256": dict(exact=False, block_n=256, num_warps=8, num_stages=3),
    "sp512": dict(exact=False, block_n=512, num_warps=8, num_stages=2),
    "sp256_qk": dict(exact=False, block_n=256, num_warps=4, num_stages=3, orient="qk"),
    "sp256_big": dict(exact=False, block_n=256, num_warps=8, num_stages=3, tokens_per_program=16384),
    # around the 2026-11-30 winner sp256_qk (0.62 of copy at 1M × 32): deeper pipelining, wider tiles, fewer programs
    "sp256_qk_s4": dict(exact=False, block_n=256, num_warps=4, num_stages=4, orient="qk"),
    "sp512_qk": dict(exact=False, block_n=512, num_warps=8, num_stages=3, orient="qk"),
    "sp128_qk_s4": dict(exact=False, block_n=128, num_warps=4, num_stages=4, orient="qk"),
    "sp256_qk_big": dict(exact=False, block_n=256, num_warps=4, num_stages=3, orient="qk", tokens_per_program=16384),
    # the scale gather one chunk ahead (`prefetch`), around the winner sp128_qk_s4 (0.69 at 1M × 32)
    "sp128_qk_s4_pf": dict(exact=False, block_n=128, num_warps=4, num_stages=4, orient="qk", prefetch=True),
    "sp128_qk_s3_pf": dict(exact=False, block_n=128, num_warps=4, num_stages=3, orient="qk", prefetch=True),
    "sp256_qk_s4_pf": dict(exact=False, block_n=256, num_warps=4, num_stages=4, orient="qk", prefetch=True),
    "sp128_qk_s4_pf_big": dict(exact=False, block_n=128, num_warps=4, num_stages=4, orient="qk", prefetch=True,
                               tokens_per_program=16384),
    # the key gather hangs off the page-table load: Triton 3.6 double-buffers it only from num_stages = 5 (three
    # buffers from 8; see mla.sparse_gpu_triton.WIDE). Timed 2026-12-01 at 128K × 32: s5 194 µs (the best), 256-key
    # w8 200, 64-key s6 / s8 219-220, sp128_qk_s3_pf 198. ptxas: regs / shared memory
    "sp128_qk_s5_pf": dict(exact=False, block_n=128, num_warps=4, num_stages=5, orient="qk", prefetch=True),  # 130/42K
    "sp64_qk_s6_pf": dict(exact=False, block_n=64, num_warps=4, num_stages=6, orient="qk", prefetch=True),  # 96 / 25K
    "sp64_qk_s8_pf": dict(exact=False, block_n=64, num_warps=4, num_stages=8, orient="qk", prefetch=True),  # 96 / 34K
    "sp256_qk_w8_s5_pf": dict(exact=False, block_n=256, num_warps=8, num_stages=5, orient="qk",
                              prefetch=True),  # 128 / 77K
    # at 32K and 128K × 32 the auto rule made 1024 programs (≈ 2 waves of 4 per SM, 8 and 32 chunks each);
    # half as many (one wave) run twice as long, so the pipeline's fill and drain are paid half as often. Measured
    # at 128K × 32 (2026-12-01): 195.6 / 228.9 µs vs 195.2 for s5 with the default rule: no gain
    "sp128_qk_s5_pf_1w": dict(exact=False, block_n=128, num_warps=4, num_stages=5, orient="qk", prefetch=True,
                              target_programs=2 * 132),
    "sp128_qk_s8_pf_1w": dict(exact=False, block_n=128, num_warps=4, num_stages=8, orient="qk", prefetch=True,
                              target_programs=2 * 132),
    # ncu at 32K × 32 — kernel 49.8 µs plus three XLA fusions preparing q (2.6-3.1 µs each) of a 58 µs
    # call. q prepared in the kernel (as sparse MLA's q_inside, which took that op from 42.5 to 38.6 µs): 128
    # registers, 42 KB for sm_90, bit-equal to the outside path in interpret mode. Timed 2026-12-01 (H200):
    # 191.1 vs 193.1 µs at 128K × 32 (0.702 of copy), 54.4 µs at 32K
    "sp128_qk_s5_pf_qi": dict(exact=False, block_n=128, num_warps=4, num_stages=5, orient="qk", prefetch=True,
                              q_inside=True),
    # one wave of 4 programs per SM at 32K × 32 (512 programs of 2048 keys instead of 1024 of 1024): there the fixed
    # cost per program (q, pipeline fill and drain, ≈ 3 µs by the 32K / 128K times) is the largest share. Timed
    # 2026-12-01: 52.0 µs at 32K × 32 (0.63 of copy) vs 54.4-55.7 for sp128_qk_s5_pf_qi; 187.7 vs 188.9 at 128K
    "sp128_qk_s5_pf_qi_1w": dict(exact=False, block_n=128, num_warps=4, num_stages=5, orient="qk", prefetch=True,
                                 q_inside=True, target_programs=2 * 132),
    # the qk loop's SASS re-reads q's mma fragments from shared
    # memory every chunk and assembles each HMMA's A operand with 4 register moves: 150 IMAD.MOV of 645 loop
    # instructions per warp (20 per key). With the keys as the M side (kq) the dot is one wgmma (HGMMA, M = 128
    # keys per warpgroup, q the shared-memory operand): 486 per warp (15 per key), 132 registers. Timed 2026-12-01 at
    # 128K × 32: 210 / 217 / 284 µs vs 198 for the qk preset in the same run — slower: the loop's instruction count
    # is not what bounds this kernel (ncu at 32K: 0.53 issued per scheduler cycle, DRAM 60% busy)
    "sp128_kq_s5_pf_qi": dict(exact=False, block_n=128, num_warps=4, num_stages=5, orient="kq", prefetch=True,
                              q_inside=True),  # 132 / 42K
    "sp128_kq_s8_pf_qi": dict(exact=False, block_n=128, num_warps=4, num_stages=8, orient="kq", prefetch=True,
                              q_inside=True),  # 132 / 59K, 3 buffers
    "sp256_kq_w8_s5_pf_qi": dict(exact=False, block_n=256, num_warps=8, num_stages=5, orient="kq", prefetch=True,
                                 q_inside=True),  # 138 / 77K
}


def _kq_f8(block_n: int, num_stages: int, num_warps: int = 4, waves=None) -> dict:
    """An fp8-dot preset: keys the M side, q prepared in the kernel, the scale gather one chunk ahead; `waves`
    programs per H200 SM (target_programs = waves · 132; None: the automatic ≈ 4 per SM)."""
    kw = dict(exact=False, block_n=block_n, num_warps=num_warps, num_stages=num_stages, orient="kq", prefetch=True,
              q_inside=True, dot_dtype="fp8")
    return kw if waves is None else dict(kw, target_programs=waves * 132)


# the fp8 codes straight into fp8 wgmma (keys the M side) against two e4m3 planes of q (`dot_dtype="fp8"`):
# no conversion of the keys at all — 368 loop instructions per 128 keys instead of 645 (pip triton 3.6 screen), three
# key buffers in flight; timings at `STORAGE_PRESET`
FAST.update({
    "sp128_kq_s5_pf_qi_1w_f8": _kq_f8(128, 5, waves=2),
    "sp128_kq_s5_pf_qi_f8": _kq_f8(128, 5),
    "sp128_kq_s5_pf_qi_3w_f8": _kq_f8(128, 5, waves=3),
    "sp128_kq_s6_pf_qi_1w_f8": _kq_f8(128, 6, waves=2),
    "sp256_kq_s5_pf_qi_1w_f8": _kq_f8(256, 5, waves=2),
    "sp256_kq_s5_pf_qi_f8": _kq_f8(256, 5),
    "sp256_kq_s4_pf_qi_1w_f8": _kq_f8(256, 4, waves=2),
    "sp256_kq_w8_s5_pf_qi_1w_f8": _kq_f8(256, 5, num_warps=8, waves=2),
    "sp64_kq_s6_pf_qi_1w_f8": _kq_f8(64, 6, waves=2),
    "sp64_kq_s6_pf_qi_f8": _kq_f8(64, 6),
    "sp64_kq_s6_pf_qi_3w_f8": _kq_f8(64, 6, waves=3),
    "sp64_kq_s8_pf_qi_1w_f8": _kq_f8(64, 8, waves=2),
})


# `precision="storage"` (single-pass products, the storage formats' bar): the fastest correct settings of the H200
# sweeps. On the H200 (2026-12-01): fp8 tensor-core dots on the stored codes (`dot_dtype=
# "fp8"`, keys the wgmma M side), one wave of programs, 6e-4 relative RMS — at 1M × 32 1,228 µs (0.87 of copy; was
# 0.70), at 128K × 32 162.6 µs (0.82; was 0.66-0.70) with 256-key blocks; at 32K × 32 64-key blocks win: 47.2 µs
# (dsa_profile; 48.8 in the bench: 0.68-0.70 of copy) vs 50.1-50.2 for 256 and 52.1 for the previous
# sp128_qk_s5_pf_qi_1w. Which one runs depends on the tokens a sequence's table spans (`storage_preset`); 64K is the
# switch, between the two measured contexts. Also timed at 32K (µs): 256-key w8 50.0, s4 54.8, auto programs 56.0;
# 128-key 1w 50.1 (s5) / 58.5 (s6), 3 waves 58.6, auto 53.4; 64-key s8 47.8, auto 53.2. At 128K: 64-key s6 / s8
# 169.6 / 168.8, 256-key w8 163.5, 128-key 1w 202.7, auto 182.1.
STORAGE_PRESET = "sp256_kq_s5_pf_qi_1w_f8"  # long contexts
STORAGE_PRESET_SHORT = "sp64_kq_s6_pf_qi_1w_f8"  # tables of ≤ SHORT_CONTEXT tokens
SHORT_CONTEXT = 65536


def storage_preset(tokens: int) -> str:
    """The `FAST` preset `precision="storage"` runs for block tables spanning `tokens` positions (max_blocks·page)."""
    return STORAGE_PRESET_SHORT if tokens <= SHORT_CONTEXT else STORAGE_PRESET


@jit
def _dot(keys, q_hi, q_lo, PLANES: tl.constexpr, KQ: tl.constexpr):
    """Σ over the q planes of q·keys: [BN, HI] (KQ: keys the M side) or [HI, BN], fp32."""
    if KQ:
        acc = tl.dot(keys, tl.trans(q_hi))
        if PLANES == 2:
            acc += tl.dot(keys, tl.trans(q_lo))
    else:
        acc = tl.dot(q_hi, tl.trans(keys))
        if PLANES == 2:
            acc += tl.dot(q_lo, tl.trans(keys))
    return acc


@jit
def _page_ids(bt_row_ptr, t, PAGE: tl.constexpr, MAX_BLOCKS: tl.constexpr, NBLOCKS: tl.constexpr):
    """Block ids of positions t (≥ 0): table reads clamped to the row, ids to [0, NBLOCKS)."""
    blk = tl.load(bt_row_ptr + tl.minimum(t // PAGE, MAX_BLOCKS - 1))
    return tl.minimum(tl.maximum(blk, 0), NBLOCKS - 1)


@jit
def _scores_kernel(bt_ptr, pos_ptr, q_ptr, w_ptr, k0_ptr, k1_ptr, out_ptr,
                   FMT: tl.constexpr, D: tl.constexpr, H: tl.constexpr, HI: tl.constexpr, BN: tl.constexpr,
                   N_INNER: tl.constexpr, OUT_COLS: tl.constexpr, PAGE: tl.constexpr, MAX_BLOCKS: tl.constexpr,
                   NBLOCKS: tl.constexpr, PLANES: tl.constexpr, KQ: tl.constexpr, CDT: tl.constexpr,
                   Q_INSIDE: tl.constexpr, PREFETCH: tl.constexpr):
    """Program (b, j) scores chunks j·N_INNER … of BN positions of sequence b.

    q: prepared `[B, PLANES, HI, D]` in the dot dtype (CDT 0 f16 / 1 bf16; mxfp4: columns [even | odd]) with w
    `[B, HI]` f32, or (Q_INSIDE) the raw q `[B, H, D]` f32 and w `[B, H]` f32, normalised here per head by a power
    of two (folded into w) and converted (CDT 2: two e4m3 planes of q·256/s_h, the codes dotted as stored).
    Keys: fp8 codes `[rows, D]` + f32 scales `[rows, 1]`; mxfp4 packed `[rows, D/2]` + E8M0 bytes `[rows, D/32]`;
    bf16 `[rows, D]` (k1 unused). out `[B, OUT_COLS]` f32."""
    b = tl.program_id(0)
    j = tl.program_id(1)
    pos_b = tl.load(pos_ptr + b)
    bt_row = bt_ptr + b * MAX_BLOCKS
    hs = tl.arange(0, HI)
    ar = tl.arange(0, BN)
    W: tl.constexpr = D // 2 if FMT == 1 else D  # loaded key columns
    cw = tl.arange(0, W)

    # q planes (hi, lo) of each column piece (a: the only piece, or mxfp4's even plane; c: mxfp4's odd plane)
    if Q_INSIDE:
        live_h = hs < H
        raw = tl.load(q_ptr + b * H * D + hs[:, None] * D + cw[None, :], mask=live_h[:, None], other=0.0)
        s_h = pow2_at_least(tl.max(tl.abs(raw), axis=1))
        w = tl.load(w_ptr + b * H + hs, mask=live_h, other=0.0) * s_h
        if CDT == 2:
            xs = raw * (256.0 / s_h[:, None])
            qa_hi = xs.to(tl.float8e4nv)
            qa_lo = (xs - qa_hi.to(tl.float32)).to(tl.float8e4nv)
            w = w * (1.0 / 256.0)
        elif CDT == 1:
            qa_hi = (raw / s_h[:, None]).to(tl.bfloat16)
            qa_lo = qa_hi
        else:
            qa_hi = (raw / s_h[:, None]).to(tl.float16)
            qa_lo = qa_hi
        qc_hi = qa_hi
        qc_lo = qa_lo
    else:
        w = tl.load(w_ptr + b * HI + hs)
        qrow = q_ptr + b * PLANES * HI * D + hs[:, None] * D
        qa_hi = tl.load(qrow + cw[None, :])
        qa_lo = qa_hi
        if PLANES == 2:
            qa_lo = tl.load(qrow + HI * D + cw[None, :])
        qc_hi = qa_hi
        qc_lo = qa_lo
        if FMT == 1:
            qc_hi = tl.load(qrow + W + cw[None, :])
            qc_lo = qc_hi
            if PLANES == 2:
                qc_lo = tl.load(qrow + HI * D + W + cw[None, :])

    chunk0 = j * N_INNER
    ahead = pos_b - chunk0 * BN
    n_live = tl.where(ahead < 0, 0, tl.minimum(ahead // BN + 1, N_INNER))

    if PREFETCH:  # fp8: the scales of the next chunk and the page ids of the one after, carried across iterations
        t0 = chunk0 * BN + ar
        sc_next = tl.load(k1_ptr + (_page_ids(bt_row, t0, PAGE, MAX_BLOCKS, NBLOCKS).to(tl.int64) * PAGE
                                    + t0 % PAGE))
        blk_next = _page_ids(bt_row, t0 + BN, PAGE, MAX_BLOCKS, NBLOCKS)
    else:
        sc_next = tl.zeros([BN], tl.float32)
        blk_next = tl.zeros([BN], tl.int32)

    for i in range(0, n_live):
        t = (chunk0 + i) * BN + ar
        slot = _page_ids(bt_row, t, PAGE, MAX_BLOCKS, NBLOCKS).to(tl.int64) * PAGE + t % PAGE  # [BN] pool rows
        if FMT == 0:
            if PREFETCH:
                sc = sc_next
                sc_next = tl.load(k1_ptr + (blk_next.to(tl.int64) * PAGE + (t + BN) % PAGE))
                blk_next = _page_ids(bt_row, t + 2 * BN, PAGE, MAX_BLOCKS, NBLOCKS)
            else:
                sc = tl.load(k1_ptr + slot)
            codes = tl.load(k0_ptr + slot[:, None] * D + cw[None, :])
            if CDT == 0:
                codes = codes.to(tl.float16)  # exact: e4m3 ⊂ f16
            elif CDT == 1:
                codes = codes.to(tl.bfloat16)
            dots = _dot(codes, qa_hi, qa_lo, PLANES, KQ)
            if KQ:
                dots = dots * sc[:, None]
            else:
                dots = dots * sc[None, :]
        elif FMT == 1:
            packed = tl.load(k0_ptr + slot[:, None] * W + cw[None, :]).to(tl.int32)  # [BN, D/2]
            scale = e8m0_value(tl.load(k1_ptr + slot[:, None] * (D // 32) + cw[None, :] // 16).to(tl.int32))
            even = (e2m1_value(packed & 0xF) * scale).to(tl.bfloat16)
            odd = (e2m1_value(packed >> 4) * scale).to(tl.bfloat16)
            dots = _dot(even, qa_hi, qa_lo, PLANES, KQ) + _dot(odd, qc_hi, qc_lo, PLANES, KQ)
        else:
            keys = tl.load(k0_ptr + slot[:, None] * D + cw[None, :])
            dots = _dot(keys, qa_hi, qa_lo, PLANES, KQ)
        r = tl.maximum(dots, 0.0)
        if KQ:
            s = tl.sum(r * w[None, :], axis=1)
        else:
            s = tl.sum(w[:, None] * r, axis=0)
        s = s + 0.0  # −0.0 -> +0.0
        tl.store(out_ptr + b * OUT_COLS + t, tl.where(t <= pos_b, s, float("-inf")))

    for i in range(n_live, N_INNER):
        t = (chunk0 + i) * BN + ar
        tl.store(out_ptr + b * OUT_COLS + t, tl.full([BN], float("-inf"), tl.float32))


@functools.partial(jax.jit, static_argnames=("fmt", "block_n", "tokens_per_program", "exact", "interpret",
                                             "num_warps", "num_stages", "orient", "dot_dtype", "prefetch",
                                             "target_programs", "q_inside"))
def scores(q_bhd, w_bh, key_parts, block_tables, pos_b, *, fmt, block_n: int = 128, tokens_per_program=None,
           exact: bool = True, interpret: bool = False, num_warps: int = 4, num_stages: int = 3,
           orient: str = "kq", dot_dtype: str = "auto", prefetch: bool = False, target_programs: int = 4 * 132,
           q_inside: bool = False):
    """Decode index scores: q `[B, Hi, d]`, w `[B, Hi]` (Hi^-0.5·d^-0.5 folded in), key_parts `[num_blocks, page, w]`
    (fmt.parts), block_tables `[B, max_blocks]`, pos `[B]` (the query's position; keys at ≤ pos are scored)
    -> float32 `[B, max_blocks·page]`, −inf where not allowed.
    Knobs (`FAST` names measured sets): block_n (keys per dot), tokens_per_program (None: the fewest tokens per
    program, halving from 8192 and not below 512, that still make at least target_programs programs; 4 · 132 ≈ 4
    per H200 SM), orient ("kq": keys are the dot's M side, "qk": the heads are), dot_dtype ("auto" / "f16" / "bf16"
    / "fp8": see `_dot_dtype`), prefetch (fp8: the scale gather of the next chunk and the page ids of the one after
    are loaded one iteration ahead, so their latency overlaps this chunk's math), q_inside (q normalised, padded
    and converted in the kernel instead of by `_prep_q`: same bits; applies with exact=False and fp8 / bf16 keys,
    ignored otherwise), Triton num_warps / num_stages. `interpret`: Triton's interpreter on the host (CPU tests)."""
    if not supports(fmt):
        raise ValueError(f"the GPU indexer kernel reads {SUPPORTED} keys, not {fmt}")
    if orient not in ("kq", "qk"):
        raise ValueError(f"orient must be 'kq' or 'qk', got {orient!r}")
    B, Hi, d = q_bhd.shape
    if not fits(fmt, Hi, d):
        raise ValueError(f"the Triton indexer kernel needs power-of-two key widths ≥ {MIN_DOT} and, for fp8 keys, "
                         f"d ≤ {FP8_GROUP}; got {fmt.index_dtype} d = {d}")
    q_inside = q_inside and not exact and fmt.index_dtype != "mxfp4"
    H_real = Hi
    if q_inside:  # the kernel pads the heads itself (masked loads)
        Hi = padded_heads(Hi)
    elif padded_heads(Hi) != Hi:  # padded heads: q = 0 and weight 0, so they add relu(0)·0 = 0 to every score
        pad = padded_heads(Hi) - Hi
        q_bhd = jnp.pad(q_bhd, ((0, 0), (0, pad), (0, 0)))
        w_bh = jnp.pad(w_bh, ((0, 0), (0, pad)))
        Hi = Hi + pad
    nblocks, page = key_parts[0].shape[:2]
    bt = jnp.asarray(block_tables, jnp.int32)
    max_blocks = bt.shape[1]
    S = max_blocks * page
    BN = max(MIN_DOT, min(block_n, 1 << (S - 1).bit_length()))
    if not is_pow2(BN):
        raise ValueError(f"block_n {BN} must be a power of two")
    n_chunks = -(-S // BN)
    tpp = (_auto_tokens_per_program(B, n_chunks, BN, target_programs) if tokens_per_program is None
           else tokens_per_program)
    n_inner = max(1, min(tpp // BN, n_chunks))
    n_prog = -(-n_chunks // n_inner)
    if dot_dtype == "fp8" and not (q_inside and fmt.index_dtype == "fp8" and d % FP8_DOT_K == 0):
        dot_dtype = "auto"  # a performance knob, like q_inside: fp8 keys, q prepared in the kernel, fp8 MMA depth
    cdt = _dot_dtype(fmt, dot_dtype)
    if q_inside:
        q, w = q_bhd.astype(jnp.float32), w_bh.astype(jnp.float32)
        planes = 2 if cdt == jnp.float8_e4m3fn else 1
    else:
        q, w = _prep_q(q_bhd, w_bh, fmt, exact, cdt)
        planes = q.shape[1]
    flat = [p.reshape(nblocks * page, p.shape[-1]) for p in key_parts]
    if len(flat) == 1:
        flat = flat * 2  # bf16 keys: one part (the second pointer is not read)
    out_cols = n_prog * n_inner * BN
    out = call(bt, jnp.asarray(pos_b, jnp.int32), q, w, *flat,
               kernel=_scores_kernel, out_shape=jax.ShapeDtypeStruct((B, out_cols), jnp.float32),
               grid=(B, n_prog), interpret=interpret, num_warps=num_warps, num_stages=num_stages,
               name="dsa_indexer_scores_triton",
               FMT=FMT_CODE[fmt.index_dtype], D=d, H=H_real, HI=Hi, BN=BN, N_INNER=n_inner, OUT_COLS=out_cols,
               PAGE=page, MAX_BLOCKS=max_blocks, NBLOCKS=nblocks, PLANES=planes, KQ=orient == "kq",
               CDT=CDT_CODE[jnp.dtype(cdt)], Q_INSIDE=q_inside, PREFETCH=bool(prefetch and fmt.index_dtype == "fp8"))
    return out if out_cols == S else out[:, :S]
