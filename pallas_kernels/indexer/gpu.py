"""Pallas (Triton lowering) GPU kernel: DSA indexer decode scores over a sequence's paged index keys.

    score[b, s] = Σ_h w[b,h] · relu(q[b,h]·k[b,s])   for s ≤ pos[b], −inf after (and for pos[b] < 0)

The reference is `reference.scores` over `fmt.dequantize(gather_pages(...))` (what `paged.topk_indices(...,
backend="reference")` scores). Top-k is not in the kernel: `paged.select_topk` runs over the score row it writes.

Grid (B, n_prog): program (b, j) walks `n_inner` chunks of BN consecutive positions of sequence b. Per chunk it maps
positions through the block table to pool rows, gathers the BN stored keys `[BN, w]` from each part, dequantises in
registers and scores all Hi heads with one tensor-core dot.

Formats (the parts of `kimi_jax.quant.IndexKeyFormat`):
- "fp8": e4m3 codes `[d]` + fp32 scale per 128 values. The dot runs on the codes (exact in bf16); the per-token
  scale multiplies the dot per 128-group (Σ_g sc_g·(q_g·c_g)) before the relu.
- "mxfp4": packed e2m1 `[d/2]` (byte j = elements 2j (low nibble), 2j + 1 (high)) + E8M0 `[d/32]` (byte j is in
  group j // 16). Values are e2m1 · 2^(e−127) (exact in bf16); q's columns are permuted outside into [even | odd] so
  the two nibble planes are dotted separately (no interleave in registers). E8M0 byte 0 (2^-127) decodes to 0.
- "bf16": bf16 keys.
Precision: keys are exact in bf16; q (fp32) is split into hi = bf16(q) and lo = bf16(q − hi), stacked as 2·Hi rows,
so one dot with M = 2·Hi gives q·k to ≈ 2^-16 relative (fp32 accumulation). `exact=False` keeps only hi.
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

from ..mla.sparse_gpu import e2m1_value

SUPPORTED = ("fp8", "mxfp4", "bf16")
FP8_GROUP = 128
MX_GROUP = 32


def available() -> bool:
    return pltriton is not None


def supports(fmt) -> bool:
    return getattr(fmt, "index_dtype", None) in SUPPORTED


def _pow2(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


def fits(fmt, heads: int, dim: int) -> bool:
    """Whether the kernel compiles for these shapes on a GPU: power-of-two blocks, and tensor-core dots need every
    dot dimension ≥ 16 (2·Hi rows; key widths d, or d/2 for mxfp4). "auto" falls back to the reference otherwise
    (e.g. the tiny preset: Hi = 2, d = 16)."""
    width = dim // 2 if getattr(fmt, "index_dtype", None) == "mxfp4" else min(dim, FP8_GROUP)
    return (supports(fmt) and _pow2(heads) and heads >= 8 and _pow2(width) and width >= 16
            and (dim <= FP8_GROUP or dim % FP8_GROUP == 0))


def _dot_nt(a, b):
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def e8m0_value(byte_i32):
    """E8M0 scale bytes (int32) -> 2^(byte − 127) float32, built from the exponent bits (exact; byte 0 -> 0)."""
    return jax.lax.bitcast_convert_type(byte_i32 << 23, jnp.float32)


def _kernel(bt_ref, pos_ref, q_ref, w_ref, *refs, index_dtype: str, d: int, Hi: int, BN: int, n_inner: int,
            page: int, max_blocks: int, exact: bool):
    """q_ref `[B, QR, d]` bf16 (QR = 2·Hi rows hi | lo, or Hi; mxfp4: columns [even | odd]), w_ref `[B, Hi]` f32,
    key parts flattened `[num_blocks·page, w]`, out `[B, S_pad]` f32."""
    *key_refs, o_ref = refs
    b = pl.program_id(0)
    j = pl.program_id(1)
    pos_b = pos_ref[b]
    w = w_ref[b, :][:, None]  # [Hi, 1]
    QR = 2 * Hi if exact else Hi
    if index_dtype == "mxfp4":
        q_pieces = [q_ref[b, :, pl.ds(0, d // 2)], q_ref[b, :, pl.ds(d // 2, d // 2)]]
    elif index_dtype == "fp8" and d > FP8_GROUP:
        q_pieces = [q_ref[b, :, pl.ds(g * FP8_GROUP, FP8_GROUP)] for g in range(d // FP8_GROUP)]
    else:
        q_pieces = [q_ref[b, :, :]]

    def chunk(i, carry):
        t = (j * n_inner + i) * BN + jnp.arange(BN, dtype=jnp.int32)  # [BN] sequence positions
        blk = bt_ref[b, jnp.minimum(t // page, max_blocks - 1)]
        slot = blk * page + t % page
        if index_dtype == "fp8":
            codes_ref, scale_ref = key_refs
            dots = None
            for g, qg in enumerate(q_pieces):
                width = d if len(q_pieces) == 1 else FP8_GROUP
                codes = codes_ref[slot, pl.ds(g * width, width)].astype(jnp.bfloat16)  # exact
                sc = scale_ref[slot, g]  # [BN] fp32, a power of two
                part = _dot_nt(qg, codes) * sc[None, :]
                dots = part if dots is None else dots + part
        elif index_dtype == "mxfp4":
            packed_ref, e_ref = key_refs
            packed = packed_ref[slot, :].astype(jnp.int32)  # [BN, d/2]
            sc = e8m0_value(e_ref[slot, :].astype(jnp.int32))  # [BN, d/32]
            sc = jnp.broadcast_to(sc[:, :, None], (BN, d // MX_GROUP, MX_GROUP // 2)).reshape(BN, d // 2)
            even = (e2m1_value(packed & 0xF) * sc).astype(jnp.bfloat16)
            odd = (e2m1_value(packed >> 4) * sc).astype(jnp.bfloat16)
            dots = _dot_nt(q_pieces[0], even) + _dot_nt(q_pieces[1], odd)
        else:
            (keys_ref,) = key_refs
            dots = _dot_nt(q_pieces[0], keys_ref[slot, :])
        if exact:
            dots = dots.reshape(2, Hi, BN).sum(axis=0)  # hi + lo
        s = jnp.sum(w * jnp.maximum(dots, 0.0), axis=0) + 0.0  # [BN]; + 0.0 turns −0.0 into +0.0
        o_ref[b, pl.ds((j * n_inner + i) * BN, BN)] = jnp.where(t <= pos_b, s, -jnp.inf)
        return carry

    jax.lax.fori_loop(0, n_inner, chunk, 0)


def _prep_q(q_bhd, fmt, exact: bool):
    """q `[B, Hi, d]` -> bf16 `[B, QR, d]` (mxfp4: columns [even | odd]; exact: rows [hi | lo])."""
    q = q_bhd.astype(jnp.float32)
    if fmt.index_dtype == "mxfp4":
        q = jnp.concatenate([q[..., 0::2], q[..., 1::2]], axis=-1)
    hi = q.astype(jnp.bfloat16)
    if not exact:
        return hi
    return jnp.concatenate([hi, (q - hi.astype(jnp.float32)).astype(jnp.bfloat16)], axis=1)


@functools.partial(jax.jit, static_argnames=("fmt", "block_n", "tokens_per_program", "exact", "interpret",
                                             "num_warps", "num_stages"))
def scores(q_bhd, w_bh, key_parts, block_tables, pos_b, *, fmt, block_n: int = 128, tokens_per_program: int = 1024,
           exact: bool = True, interpret: bool = False, num_warps: int = 4, num_stages: int = 3):
    """Decode index scores: q `[B, Hi, d]`, w `[B, Hi]` (Hi^-0.5·d^-0.5 folded in), key_parts `[num_blocks, page, w]`
    (fmt.parts), block_tables `[B, max_blocks]`, pos `[B]` (the query's position; keys at ≤ pos are scored)
    -> float32 `[B, max_blocks·page]`, −inf where not allowed."""
    if not supports(fmt):
        raise ValueError(f"the GPU indexer kernel reads {SUPPORTED} keys, not {fmt}")
    B, Hi, d = q_bhd.shape
    nblocks, page = key_parts[0].shape[:2]
    bt = jnp.asarray(block_tables, jnp.int32)
    max_blocks = bt.shape[1]
    S = max_blocks * page
    BN = min(block_n, 1 << (S - 1).bit_length())
    widths = (d // 2,) if fmt.index_dtype == "mxfp4" else ((d,) if d <= FP8_GROUP else (FP8_GROUP,))
    if not (_pow2(Hi) and _pow2(BN) and all(_pow2(x) for x in widths)) or (d > FP8_GROUP and d % FP8_GROUP):
        raise ValueError(f"Hi {Hi}, block_n {BN} and key widths {widths} must be powers of two "
                         f"(fp8: d ≤ 128 or a multiple of 128)")
    n_chunks = -(-S // BN)
    n_inner = max(1, min(tokens_per_program // BN, n_chunks))
    n_prog = -(-n_chunks // n_inner)
    q = _prep_q(q_bhd, fmt, exact)
    flat = [p.reshape(nblocks * page, p.shape[-1]) for p in key_parts]
    kernel = functools.partial(_kernel, index_dtype=fmt.index_dtype, d=d, Hi=Hi, BN=BN, n_inner=n_inner, page=page,
                               max_blocks=max_blocks, exact=exact)
    out = pl.pallas_call(
        kernel,
        grid=(B, n_prog),
        out_shape=jax.ShapeDtypeStruct((B, n_prog * n_inner * BN), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="dsa_indexer_scores",
    )(bt, jnp.asarray(pos_b, jnp.int32), q, jnp.asarray(w_bh, jnp.float32), *flat)
    return out[:, :S]
