"""Pallas Mosaic-TPU kernel: DSA indexer decode scores over a sequence's paged index keys.

    score[b, s] = Σ_h w[b,h] · relu(q[b,h]·k[b,s])   for s ≤ pos[b], −inf after (and for pos[b] < 0)

Same contract as `gpu.scores`; the reference is `reference.scores` over the dequantised gathered pages.

Grid (B, max_blocks): one page (64 keys) per step. The block table and the query positions are scalar-prefetched
(SMEM), and every key part's BlockSpec index map reads the page id from the table, so the Pallas pipeline DMAs the
next page `[page, w]` while this one is scored (the paged-attention pattern). Pages past the query's position map to
the last page it needs, so they are not fetched again (same block index) and are masked to −inf.
In-kernel dequantisation:
- "fp8": e4m3 codes -> fp32, times the per-128 fp32 scale (a [page, 1] column per group, broadcast over lanes).
- "mxfp4": the packed bytes are split into the even (low nibble) / odd (high nibble) planes and decoded by arithmetic
  (`e2m1_value`, no table lookups); the E8M0 bytes become 2^(e−127) from their exponent bits and are spread over the
  16 bytes of their group by a one-hot matmul (exact; lane repeats are costly on TPU). q arrives with its columns
  permuted to [even | odd], so nothing is interleaved in the kernel.
- "bf16": bf16 keys -> fp32.
Scores use fp32 dots at Precision.HIGHEST; the row `[1, page]` is written per step.

SMEM: the block table and positions take 4·(max_blocks + 1) bytes per sequence; a batch whose tables exceed the SMEM
budget (`pallas_kernels.budget`) runs as several calls over batch slices. VMEM: `vmem_bytes`.

Checked on CPU in TPU interpret mode against the reference and exported for TPU; not yet run on TPU hardware (the page-per-step grid and
the [page, 1] scale blocks want tuning there: several pages per step would amortise the per-step overhead).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import numpy as np

from .. import budget
from ..codec import e2m1_value, e8m0_value

SUPPORTED = ("fp8", "mxfp4", "bf16")
FP8_GROUP = 128
MX_GROUP = 32
_HI = jax.lax.Precision.HIGHEST


def supports(fmt) -> bool:
    return getattr(fmt, "index_dtype", None) in SUPPORTED


def vmem_bytes(Hi: int, d: int, page: int, part_widths_dtypes) -> int:
    """VMEM of one call: double-buffered q `[Hi, d]`, w `[Hi, 1]`, one page of every key part `[page, w]` and the
    score row `[1, page]`, plus the in-kernel float32 copies of the page (keys, dots `[Hi, page]`)."""
    f32 = np.float32
    parts = sum(budget.tile_bytes((page, w), dt) for w, dt in part_widths_dtypes)
    return (2 * (budget.tile_bytes((Hi, d), f32) + budget.tile_bytes((Hi, 1), f32) + parts
                 + budget.tile_bytes((1, page), f32))
            + budget.tile_bytes((page, d), f32) + budget.tile_bytes((Hi, page), f32))


def smem_bytes_per_row(max_blocks: int) -> int:
    """SMEM of one sequence's prefetched tables: its block-table row and its query position (int32)."""
    return 4 * (max_blocks + 1)


def _dot_nt(a, b):
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=_HI, preferred_element_type=jnp.float32)


def _kernel(bt_ref, pos_ref, q_ref, w_ref, *refs, index_dtype: str, d: int, page: int):
    *key_refs, o_ref = refs
    b = pl.program_id(0)
    j = pl.program_id(1)
    q = q_ref[0].astype(jnp.float32)  # [Hi, d]
    w = w_ref[0]  # [Hi, 1]
    if index_dtype == "fp8":
        codes_ref, scale_ref = key_refs
        codes = codes_ref[0].astype(jnp.float32)  # [page, d]
        sc = scale_ref[0]  # [page, G]
        G = sc.shape[-1]
        width = d if G == 1 else FP8_GROUP
        dots = None
        for g in range(G):
            part = _dot_nt(q[:, g * width:(g + 1) * width], codes[:, g * width:(g + 1) * width] * sc[:, g:g + 1])
            dots = part if dots is None else dots + part
    elif index_dtype == "mxfp4":
        packed_ref, e_ref = key_refs
        packed = packed_ref[0].astype(jnp.int32)  # [page, d/2]
        sc = e8m0_value(e_ref[0].astype(jnp.int32))  # [page, d/32]
        ng, half = d // MX_GROUP, d // 2
        # lax.div (truncating) on non-negative ints: jnp's floor division lowers through sign(), which Mosaic
        # resolves per chip generation
        spread = (jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, (ng, half), 1), MX_GROUP // 2)
                  == jax.lax.broadcasted_iota(jnp.int32, (ng, half), 0)).astype(jnp.float32)
        sc = jax.lax.dot_general(sc, spread, (((1,), (0,)), ((), ())), precision=_HI,
                                 preferred_element_type=jnp.float32)  # [page, d/2]
        dots = (_dot_nt(q[:, :half], e2m1_value(packed & 0xF) * sc)
                + _dot_nt(q[:, half:], e2m1_value(packed >> 4) * sc))
    else:
        (keys_ref,) = key_refs
        dots = _dot_nt(q, keys_ref[0].astype(jnp.float32))
    s = jnp.sum(w * jnp.maximum(dots, 0.0), axis=0, keepdims=True) + 0.0  # [1, page]; −0.0 -> +0.0
    t = j * page + jax.lax.broadcasted_iota(jnp.int32, (1, page), 1)
    o_ref[0, 0] = jnp.where(t <= pos_ref[b], s, -jnp.inf)


@functools.partial(jax.jit, static_argnames=("fmt", "smem_budget", "interpret"))
def scores(q_bhd, w_bh, key_parts, block_tables, pos_b, *, fmt, smem_budget: int = budget.SMEM_BUDGET,
           interpret: bool = False):
    """Decode index scores: q `[B, Hi, d]`, w `[B, Hi]`, key_parts `[num_blocks, page, w]` (fmt.parts),
    block_tables `[B, max_blocks]`, pos `[B]` -> float32 `[B, max_blocks·page]`, −inf where not allowed.
    The batch runs in slices whose tables fit `smem_budget` bytes of SMEM."""
    if not supports(fmt):
        raise ValueError(f"the TPU indexer kernel reads {SUPPORTED} keys, not {fmt}")
    B, Hi, d = q_bhd.shape
    page = key_parts[0].shape[1]
    bt = jnp.asarray(block_tables, jnp.int32)
    max_blocks = bt.shape[1]
    pos = jnp.asarray(pos_b, jnp.int32)
    q = q_bhd.astype(jnp.float32)
    if fmt.index_dtype == "mxfp4":
        q = jnp.concatenate([q[..., 0::2], q[..., 1::2]], axis=-1)
    w = jnp.asarray(w_bh, jnp.float32)[..., None]  # [B, Hi, 1]: a column, broadcast over the page's lanes

    def page_map(b, j, bt_s, pos_s):
        last = jax.lax.div(jnp.maximum(pos_s[b], 0), page)  # no new DMA for pages past the query
        return bt_s[b * max_blocks + jnp.minimum(j, last)], 0, 0

    budget.check("indexer scores (TPU)", smem=0,
                 vmem=vmem_bytes(Hi, d, page, [(p.shape[-1], p.dtype) for p in key_parts]))
    rows_per_call = budget.batch_rows_within(B, smem_bytes_per_row(max_blocks), smem_budget=smem_budget)

    def call(bt, pos, q, w):
        Bc = q.shape[0]
        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(Bc, max_blocks),
            in_specs=[pl.BlockSpec((1, Hi, d), lambda b, j, *_: (b, 0, 0)),
                      pl.BlockSpec((1, Hi, 1), lambda b, j, *_: (b, 0, 0))]
                     + [pl.BlockSpec((1, page, p.shape[-1]), page_map) for p in key_parts],
            out_specs=pl.BlockSpec((1, 1, 1, page), lambda b, j, *_: (b, j, 0, 0)),
        )
        return pl.pallas_call(
            functools.partial(_kernel, index_dtype=fmt.index_dtype, d=d, page=page),
            grid_spec=grid_spec,
            name="indexer_scores_tpu",
            out_shape=jax.ShapeDtypeStruct((Bc, max_blocks, 1, page), jnp.float32),
            compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
            interpret=pltpu.InterpretParams() if interpret else False,
        )(bt.reshape(-1), pos, q, w, *key_parts)

    out = budget.over_batch(call, B, rows_per_call, bt, pos, q, w)
    return out.reshape(B, max_blocks * page)
