"""Pallas (Triton lowering) GPU kernel: DSA indexer decode scores over a sequence's paged index keys.

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
- "fp8": e4m3 codes `[d]` + fp32 scale per 128 values. The dot runs on the codes (exact in f16 and bf16); the
  per-token scale multiplies the dot per 128-group (Σ_g sc_g·(q_g·c_g)) before the relu.
- "mxfp4": packed e2m1 `[d/2]` (byte j = elements 2j (low nibble), 2j + 1 (high)) + E8M0 `[d/32]` (byte j is in
  group j // 16). Values are e2m1 · 2^(e−127) (exact in bf16); q's columns are permuted outside into [even | odd] so
  the two nibble planes are dotted separately (no interleave in registers). E8M0 byte 0 (2^-127) decodes to 0.
- "bf16": bf16 keys.
Precision: keys are exact in the dot dtype (f16 for fp8 keys, bf16 otherwise). Each head's q is divided by a power
of two ≥ its max |q| (folded into w: relu(q·k)·w = relu((q/s)·k)·(w·s), exact) and split into hi + lo in cdt
(`mla.sparse_gpu.split_hi_lo`: integer-mask truncation, which XLA cannot fold away — the plain f32(cdt(q)) round
trip is removed by XLA on GPU, which left q at cdt precision on the H200); two dots (hi, lo) accumulate in fp32:
q·k to ≈ 2^-21 (f16) / 2^-15 (bf16) relative.
`exact=False` keeps only hi.
Address safety: 64-bit offsets for 1-byte parts of 2^31…2^32 bytes (the lowering's int32 wrap, see
`pallas_kernels.paged.ensure_triton_wide_offsets`), block ids clamped into [0, num_blocks).
Constraints (Triton blocks are powers of two): Hi, BN, and the loaded key widths (d, or d/2 for mxfp4; fp8 needs
d ≤ 128 or d % 128 == 0). K3.1: Hi = 32, d = 128.
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
from ..mla.sparse_gpu import (  # one Triton probe, shared helpers
    MIN_DOT, _pow2, _pow2_at_least, available, split_hi_lo)
from ..paged import pool_offsets_safe
from ..triton_prims import fp8_dot_nt

SUPPORTED = ("fp8", "mxfp4", "bf16")
FP8_GROUP = 128
MX_GROUP = 32


def supports(fmt) -> bool:
    return getattr(fmt, "index_dtype", None) in SUPPORTED


def fits(fmt, heads: int, dim: int) -> bool:
    """Whether the kernel compiles for these shapes on a GPU: power-of-two key widths (d, or d/2 for mxfp4) of at
    least 16, since tensor-core dots need every dot dimension ≥ 16. Any head count works: `scores` pads the heads to
    a power of two ≥ 16 (zero q and weight). "auto" falls back to the reference otherwise (e.g. d = 8)."""
    width = dim // 2 if getattr(fmt, "index_dtype", None) == "mxfp4" else min(dim, FP8_GROUP)
    return (supports(fmt) and heads >= 1 and _pow2(width) and width >= MIN_DOT
            and (dim <= FP8_GROUP or dim % FP8_GROUP == 0))


def padded_heads(Hi: int) -> int:
    """The kernel's head count: a power of two ≥ MIN_DOT (16). Every tensor-core dot dimension must be ≥ 16 — Hi is
    the M side of the "qk" dot and the N side of the "kq" one; on the H200 the tiny model's 8 heads gave wrong
    scores."""
    return max(MIN_DOT, 1 << (Hi - 1).bit_length())


def _dot_nt(a, b):
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def e8m0_value(byte_i32):
    """E8M0 scale bytes (int32) -> 2^(byte − 127) float32, built from the exponent bits (exact; byte 0 -> 0)."""
    return jax.lax.bitcast_convert_type(byte_i32 << 23, jnp.float32)


def _kernel(bt_ref, pos_ref, q_ref, w_ref, *refs, index_dtype: str, d: int, Hi: int, BN: int, n_inner: int,
            page: int, max_blocks: int, nblocks: int, exact: bool, orient: str, cdt, prefetch: bool = False,
            H=None):
    """q_ref `[B, 2, Hi, d]` (plane 0 = hi, plane 1 = lo; mxfp4: columns [even | odd]) in the dot dtype `cdt`,
    w_ref `[B, Hi]` f32 (the per-head power-of-two q normalisation folded in), key parts flattened
    `[num_blocks·page, w]`, out `[B, S_pad]` f32.

    Address safety: positions are ≥ 0 by construction, table reads are clamped to the row, block ids to
    [0, nblocks) — no load can leave the pool whatever the table holds — and the big 1-byte parts get 64-bit offsets
    (`pallas_kernels.paged.ensure_triton_wide_offsets`).

    prefetch (fp8 keys): the per-token scales of chunk i + 1 and the page ids of chunk i + 2 are loaded in iteration
    i and carried to the next one. Triton's pipeliner software-pipelines only the loads that feed a dot (the codes);
    the scale gather stayed a synchronous load whose latency every chunk waited for. A load's value is only waited
    for where it is used, so a value carried across the iteration boundary arrives during this chunk's math.

    H (q prepared in the kernel: exact=False, fp8 / bf16 keys): q_ref is the raw q `[B, H, d]` f32 and w_ref the raw
    w `[B, H]`; the kernel loads heads ≥ H as zeros, divides each head by its power of two (`_pow2_at_least`, =
    `pow2_scale`), folds it into w and converts q to cdt — `_prep_q`'s bits without its three XLA launches."""
    *key_refs, o_ref = refs
    b = pl.program_id(0)
    j = pl.program_id(1)
    fp8_dots = cdt == jnp.float8_e4m3fn  # the codes as stored, q as two e4m3 planes (prepared here: H is set)
    pos_b = pos_ref[b]
    planes = (0, 1) if exact else (0,)
    if index_dtype == "mxfp4":
        cols = [(0, d // 2), (d // 2, d // 2)]
    elif index_dtype == "fp8" and d > FP8_GROUP:
        cols = [(g * FP8_GROUP, FP8_GROUP) for g in range(d // FP8_GROUP)]
    else:
        cols = [(0, d)]
    if H is not None:  # q prepared here (one plane)
        live_h = jnp.arange(Hi) < H
        raw = [pltriton.load(q_ref.at[b, pl.ds(0, Hi), pl.ds(c0, cw)], mask=live_h[:, None], other=0.0)
               for (c0, cw) in cols]  # [Hi, width] f32 each
        s_h = _pow2_at_least(functools.reduce(jnp.maximum, [jnp.max(jnp.abs(x), axis=1) for x in raw]))  # [Hi]
        w = pltriton.load(w_ref.at[b, pl.ds(0, Hi)], mask=live_h, other=0.0) * s_h
        if fp8_dots:  # two e4m3 planes of q·256/s_h (|x| < 256 ≤ 448, subnormals below 2^-6): hi + lo to ≈ 2^-8
            xs = [x * (FP8_Q_RANGE / s_h[:, None]) for x in raw]
            his = [x.astype(cdt) for x in xs]
            qs = [his, [(x - h.astype(jnp.float32)).astype(cdt) for x, h in zip(xs, his)]]
            w = w * (1.0 / FP8_Q_RANGE)
        else:
            qs = [[(x / s_h[:, None]).astype(cdt) for x in raw]]
    else:
        w = w_ref[b, :]  # [Hi]
        # q pieces [plane][piece] -> [Hi, width]
        qs = [[q_ref[b, p, :, pl.ds(c0, cw)] for (c0, cw) in cols] for p in planes]

    def dot(keys, piece):
        """Σ over hi/lo planes of q·keys for one column piece: [BN, Hi] ("kq") or [Hi, BN] ("qk"), fp32."""
        out = None
        dot_nt = fp8_dot_nt if fp8_dots else _dot_nt
        for p in range(len(qs)):
            x = dot_nt(keys, qs[p][piece]) if orient == "kq" else dot_nt(qs[p][piece], keys)
            out = x if out is None else out + x
        return out

    def per_token(sc):  # [BN] -> broadcast against the dot layout
        return sc[:, None] if orient == "kq" else sc[None, :]

    chunk0 = j * n_inner  # first chunk of this program
    # chunks wholly past the query position are not read (only written −inf): dynamic trip counts
    n_live = jnp.clip((pos_b - chunk0 * BN) // BN + 1, 0, n_inner)

    def positions(chunk):
        return chunk * BN + jnp.arange(BN, dtype=jnp.int32)  # [BN] sequence positions, ≥ 0

    def page_ids(t):
        blk = bt_ref[b, jnp.minimum(t // page, max_blocks - 1)]
        return jnp.minimum(jnp.maximum(blk, 0), nblocks - 1)

    def pool_row(t, blk):
        return blk * page + t % page

    def scales(slot):  # fp8: the per-token scale of each 128-group, [BN] fp32 each (powers of two)
        return tuple(key_refs[1][slot, g] for g in range(len(cols)))

    def live(i, carry):
        c0 = (chunk0 + i) * BN
        t = positions(chunk0 + i)
        slot = pool_row(t, page_ids(t))
        if index_dtype == "fp8":
            codes_ref, scale_ref = key_refs
            if prefetch:
                sc_now, blk_next = carry
                t1 = positions(chunk0 + i + 1)
                t2 = positions(chunk0 + i + 2)
                carry = (scales(pool_row(t1, blk_next)), page_ids(t2))  # used in the next iteration
            else:
                sc_now = scales(slot)
            dots = None
            for g, (c0_, cw) in enumerate(cols):
                codes = codes_ref[slot, pl.ds(c0_, cw)].astype(cdt)  # exact (e4m3 ⊂ f16, bf16); fp8: as stored
                part = dot(codes, g) * per_token(sc_now[g])
                dots = part if dots is None else dots + part
        elif index_dtype == "mxfp4":
            packed_ref, e_ref = key_refs
            packed = packed_ref[slot, :].astype(jnp.int32)  # [BN, d/2]
            sc = e8m0_value(e_ref[slot, :].astype(jnp.int32))  # [BN, d/32]
            sc = jnp.broadcast_to(sc[:, :, None], (BN, d // MX_GROUP, MX_GROUP // 2)).reshape(BN, d // 2)
            even = (e2m1_value(packed & 0xF) * sc).astype(cdt)
            odd = (e2m1_value(packed >> 4) * sc).astype(cdt)
            dots = dot(even, 0) + dot(odd, 1)
        else:
            (keys_ref,) = key_refs
            dots = dot(keys_ref[slot, :].astype(cdt), 0)
        r = jnp.maximum(dots, 0.0)
        s = jnp.sum(r * w[None, :], axis=1) if orient == "kq" else jnp.sum(w[:, None] * r, axis=0)
        s = s + 0.0  # −0.0 -> +0.0
        o_ref[b, pl.ds(c0, BN)] = jnp.where(t <= pos_b, s, -jnp.inf)
        return carry

    def dead(i, carry):
        o_ref[b, pl.ds((chunk0 + i) * BN, BN)] = jnp.full((BN,), -jnp.inf, jnp.float32)
        return carry

    use_prefetch = prefetch and index_dtype == "fp8"
    if use_prefetch:
        t0 = positions(chunk0)
        carry0 = (scales(pool_row(t0, page_ids(t0))), page_ids(positions(chunk0 + 1)))
    jax.lax.fori_loop(0, n_live, live, carry0 if use_prefetch else 0)
    jax.lax.fori_loop(n_live, n_inner, dead, 0)


FP8_DOT_K = 32  # an fp8 tensor-core instruction's contraction depth: fp8 dots need d to be a multiple of it
FP8_Q_RANGE = 256.0  # dot_dtype "fp8": each head's q scaled to |x| < 256 (e4m3: max 448, normal from 2^-6)


def _dot_dtype(fmt, dot_dtype: str):
    """The tensor-core operand dtype: f16 where the stored keys are exact in it (fp8 e4m3: 4-bit exponent; the
    cheap native e4m3 -> f16 conversion on sm_89+, and 11-bit mantissa for q), bf16 otherwise (bf16 keys; mxfp4,
    whose E8M0 scales reach outside f16's range). "fp8" (fp8 keys with q prepared in the kernel, i.e. q_inside and
    single-pass, and d a multiple of FP8_DOT_K; `scores` falls back to "auto" otherwise): the stored codes go to the
    tensor cores as they are — no conversion — against q as two e4m3 planes hi + lo (≈ 2^-8 relative), through
    `triton_prims.fp8_dot_nt` (fast accumulation: Triton's condition for wgmma; 6e-4 relative RMS on the H200 at
    K3 shapes)."""
    if dot_dtype == "auto":
        dot_dtype = "f16" if fmt.index_dtype == "fp8" else "bf16"
    if dot_dtype not in ("f16", "bf16", "fp8"):
        raise ValueError(f"dot_dtype must be 'auto', 'f16', 'bf16' or 'fp8', got {dot_dtype!r}")
    if dot_dtype == "f16" and fmt.index_dtype != "fp8":
        raise ValueError(f"dot_dtype {dot_dtype} is exact only for fp8 keys, not {fmt.index_dtype}")
    return {"f16": jnp.float16, "bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn}[dot_dtype]


def pow2_scale(x, axis=-1):
    """A power of two s ≥ max|x| along `axis` (keepdims; 1 where x is all zero): x / s is in (−1, 1) exactly."""
    m = jnp.max(jnp.abs(x), axis=axis, keepdims=True)
    _, e = jnp.frexp(m)
    return jnp.where(m > 0, jnp.ldexp(jnp.ones_like(m), e), 1.0)


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
# bench check exactly this). The bench sweeps them against the default.
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
    # buffers from 8; see mla.sparse_gpu.WIDE). Timed 2026-12-01 at 128K × 32: s5 194 µs (the best), 256-key w8
    # 200, 64-key s6 / s8 219-220, sp128_qk_s3_pf 198. ptxas: regs / shared memory
    "sp128_qk_s5_pf": dict(exact=False, block_n=128, num_warps=4, num_stages=5, orient="qk", prefetch=True),  # 130/42K
    "sp64_qk_s6_pf": dict(exact=False, block_n=64, num_warps=4, num_stages=6, orient="qk", prefetch=True),  # 96 / 25K
    "sp64_qk_s8_pf": dict(exact=False, block_n=64, num_warps=4, num_stages=8, orient="qk", prefetch=True),  # 96 / 34K
    "sp256_qk_w8_s5_pf": dict(exact=False, block_n=256, num_warps=8, num_stages=5, orient="qk", prefetch=True),  # 128/77K
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
    # the qk loop's SASS (bench/triton_regs.py --op indexer --sass) re-reads q's mma fragments from shared
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


def supports_pool(key_parts) -> bool:
    """Whether every row of these pool parts is addressable by the kernel (see `paged.pool_offsets_safe`)."""
    return pool_offsets_safe(key_parts)


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
    Knobs: block_n (keys per dot), tokens_per_program (None: the fewest tokens per program, halving from 8192 and
    not below 512, that still make at least target_programs programs; 4 · 132 ≈ 4 per H200 SM), orient ("kq": keys are the
    dot's M side, "qk": the heads are), dot_dtype ("auto" / "f16" / "bf16" / "fp8": see `_dot_dtype`), prefetch
    (fp8: the scale gather one chunk ahead, see `_kernel`), q_inside (q normalised, padded and converted in the kernel instead of by
    `_prep_q`: same bits; applies with exact=False and fp8 / bf16 keys, ignored otherwise), Triton num_warps /
    num_stages."""
    if not supports(fmt):
        raise ValueError(f"the GPU indexer kernel reads {SUPPORTED} keys, not {fmt}")
    if orient not in ("kq", "qk"):
        raise ValueError(f"orient must be 'kq' or 'qk', got {orient!r}")
    B, Hi, d = q_bhd.shape
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
    if not supports_pool(key_parts):
        raise ValueError("this jax's Triton lowering would address the pool with wrapping 32-bit offsets "
                         "(a 1-byte part of 2^31…2^32 bytes); use the reference backend")
    bt = jnp.asarray(block_tables, jnp.int32)
    max_blocks = bt.shape[1]
    S = max_blocks * page
    BN = min(block_n, 1 << (S - 1).bit_length())
    widths = (d // 2,) if fmt.index_dtype == "mxfp4" else ((d,) if d <= FP8_GROUP else (FP8_GROUP,))
    if not (_pow2(Hi) and _pow2(BN) and all(_pow2(x) for x in widths)) or (d > FP8_GROUP and d % FP8_GROUP):
        raise ValueError(f"Hi {Hi}, block_n {BN} and key widths {widths} must be powers of two "
                         f"(fp8: d ≤ 128 or a multiple of 128)")
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
    else:
        q, w = _prep_q(q_bhd, w_bh, fmt, exact, cdt)
    flat = [p.reshape(nblocks * page, p.shape[-1]) for p in key_parts]
    kernel = functools.partial(_kernel, index_dtype=fmt.index_dtype, d=d, Hi=Hi, BN=BN, n_inner=n_inner, page=page,
                               max_blocks=max_blocks, nblocks=nblocks, exact=exact, orient=orient, cdt=cdt,
                               **(dict(prefetch=True) if prefetch else {}),
                               **(dict(H=H_real) if q_inside else {}))
    out = pl.pallas_call(
        kernel,
        grid=(B, n_prog),
        out_shape=jax.ShapeDtypeStruct((B, n_prog * n_inner * BN), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="dsa_indexer_scores",
    )(bt, jnp.asarray(pos_b, jnp.int32), q, w, *flat)
    return out if out.shape[1] == S else out[:, :S]
