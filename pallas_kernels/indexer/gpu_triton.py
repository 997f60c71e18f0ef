"""Native Triton GPU kernel (launched through jax-triton): DSA indexer decode scores over a sequence's paged keys.

    score[b, s] = Σ_h w[b,h] · relu(q[b,h]·k[b,s])   for s ≤ pos[b], −inf after (and for pos[b] < 0)

The same algorithm, knobs and presets as the Pallas Triton kernel `gpu.py` (whose docstring has the full story:
grid (B, n_prog), dynamic trip counts, dequantisation in registers, the hi/lo q planes, the fp8 dot on the stored
codes, the prefetched scale gather); its reference is `reference.scores` over the dequantised gathered pages.
What differs:
- Addressing: pool rows are int64 before they are multiplied by the row width, so pools past 2^31 bytes need no
  patch of a lowering (`paged.ensure_triton_wide_offsets` is for the Pallas kernels only).
- q pieces: fp8 keys need d ≤ 128 here (one scale group: K3.1 and DeepSeek-V3.2 have d = 128); `fits` says so and
  "auto" falls back to the reference otherwise.
- Portability: plain `tl` operations only (no inline PTX), so the kernel compiles for ROCm too; its fp8 dot needs
  OCP e4m3 tensor-core support (Hopper, Ada; AMD MI350 — not MI300, whose fp8 is e4m3fnuz), see docs/gpu.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..triton_call import available as _launcher_available
from ..triton_call import call, jit, tl
from ..triton_codec import e2m1_value, e8m0_value, pow2_at_least
from .gpu import (  # the knobs, presets and q preparation are shared with the Pallas kernel
    FAST, FP8_DOT_K, FP8_GROUP, FP8_Q_RANGE, MIN_DOT, SUPPORTED, _auto_tokens_per_program, _dot_dtype, _pow2,
    _prep_q, padded_heads, storage_preset)

__all__ = ["FAST", "available", "fits", "scores", "storage_preset", "supports"]

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
    return supports(fmt) and heads >= 1 and _pow2(width) and width >= MIN_DOT and (kind != "fp8" or dim <= FP8_GROUP)


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
    """Decode index scores, as `gpu.scores` (same arguments and knobs, same `FAST` presets): q `[B, Hi, d]`,
    w `[B, Hi]` (Hi^-0.5·d^-0.5 folded in), key_parts `[num_blocks, page, w]` (fmt.parts), block_tables
    `[B, max_blocks]`, pos `[B]` -> float32 `[B, max_blocks·page]`, −inf where not allowed. `interpret`: Triton's
    interpreter on the host (CPU tests)."""
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
    if not _pow2(BN):
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
