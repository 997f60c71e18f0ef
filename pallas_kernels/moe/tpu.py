"""TPU grouped matmul for MoE experts: a Pallas Mosaic TPU kernel (CPU tests run it in TPU interpret mode).

Grid (column block n, row tile t, contraction step k), k innermost, all "arbitrary". Row tiles follow
`schedule.straddle_tiles`: BlockSpecs address aligned (bm, ·) row blocks, so a block shared by several experts is
visited once per expert, consecutively; each visit stores only its expert's rows and keeps the rest of the output
block (which stays resident in VMEM while its block index does not change). The first visit of a block starts from
zeros, so rows of no expert (and the pseudo-group of uncovered rows) come out as zeros. The expert id, block index
and group bounds arrive by scalar prefetch and drive the index maps: each step DMAs one x block and one weight
block of the tile's expert; steps past the live tile count repeat the last tile's block indices (no DMA) and skip
the matmul.

MXFP4 weights: packed `[E, N, K/2]` blocks `(bn, bk/2)` (uint8) and the expert's whole scale row `[bn, K/32]` (it is
K/16 of the packed bytes and its last dimension is not 128-aligned, so it is fetched once per (n, t) and the k-th
slice is picked on the MXU with two 0/1 matrices — exact, since scales are powers of two). Codes are decoded with
int32/f32 ops (`mxfp4.decode_lo_hi_f32`); x arrives pre-split into even and odd input elements, so the nibbles
need no interleaving: acc += x_even @ W_loᵀ + x_odd @ W_hiᵀ.

Cost on paper (not measured here; v5e: 197 TFLOP/s bf16, 819 GB/s HBM, ridge ≈ 240 FLOP/byte). A bf16 step
moves bk·bn·2 weight bytes for 2·bm·bk·bn FLOPs: bm FLOP/byte, so bm = 128 tiles sit just under the ridge and K3
prefill (146 rows per expert) is within ~2x of both roofs; straddled blocks add up to E extra row-block visits
(112 on 128 blocks at K3 shapes). MXFP4 decode steps move bk·bn/2 bytes and decode bk·bn elements with ~12 VPU ops
each plus the scale pick (two matmuls of 2·bn·(K/32)·bk/32 and 2·bn·bk/2 FLOPs): DMA-bound only if the VPU keeps
up, which is the first thing to measure on a TPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import numpy as np

import pallas_kernels.moe.mxfp4 as mx  # not `from . import`: see moe/ops.py

from .. import budget
from .schedule import cdiv, num_straddle_tiles_bound, straddle_tiles


@dataclasses.dataclass(frozen=True)
class TpuConfig:
    bm: int = 128
    bn: int = 256
    bk: int = 512


def _fit(dim: int, pref: int, floor: int) -> int:
    """The largest pref/2^i ≥ floor dividing dim, else the whole dim (a full-extent block is always legal)."""
    b = pref
    while b >= floor:
        if dim % b == 0:
            return b
        b //= 2
    return dim


def vmem_bytes(bm: int, bk: int, bn: int, K: int, n_w: int, x_dtype, w_dtype, out_dtype, quantized: bool) -> int:
    """VMEM of one call: double-buffered x, weight (MXFP4: packed `[bn, bk/2]` + the scale row `[bn, K/32]`) and
    output blocks, plus one float32 `[bm, bn]` accumulator per weight."""
    if quantized:
        x = 2 * budget.tile_bytes((bm, bk // 2), x_dtype)
        w = budget.tile_bytes((bn, bk // 2), np.uint8) + budget.tile_bytes((bn, K // mx.GROUP), np.uint8)
    else:
        x = budget.tile_bytes((bm, bk), x_dtype)
        w = budget.tile_bytes((bk, bn), w_dtype)
    return (2 * (x + n_w * w + budget.tile_bytes((bm, bn), out_dtype))
            + n_w * budget.tile_bytes((bm, bn), np.float32))


def _select_scales(s_f32, k, ks: int, kh: int):
    """Columns [k·ks, (k+1)·ks) of `s [bn, S]`, each repeated 16 times -> `[bn, kh]`, through two 0/1 matmuls."""
    S = s_f32.shape[1]
    rows = jax.lax.broadcasted_iota(jnp.int32, (S, ks), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (S, ks), 1)
    pick = (rows == k * ks + cols).astype(jnp.bfloat16)
    s_k = jnp.dot(s_f32.astype(jnp.bfloat16), pick, preferred_element_type=jnp.float32)  # powers of 2: exact
    rows = jax.lax.broadcasted_iota(jnp.int32, (ks, kh), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (ks, kh), 1)
    rep = (rows == jax.lax.shift_right_logical(cols, 4)).astype(jnp.bfloat16)  # 16 bytes per scale
    return jnp.dot(s_k.astype(jnp.bfloat16), rep, preferred_element_type=jnp.float32)


def _dot_nt(a, b):
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _kernel(grp_ref, blk_ref, first_ref, gstart_ref, gend_ref, num_ref, *refs, E: int, bm: int, bk: int, n_k: int,
            quantized: bool, n_w: int, activation):
    n_x = 2 if quantized else 1
    n_wref = 2 * n_w if quantized else n_w
    x_refs = refs[:n_x]
    w_refs = refs[n_x:n_x + n_wref]
    o_ref = refs[n_x + n_wref]
    acc_refs = refs[n_x + n_wref + 1:]
    t = pl.program_id(1)
    k = pl.program_id(2)
    g = grp_ref[t]
    live = t < num_ref[0]

    @pl.when(k == 0)
    def _init():
        for a in acc_refs:
            a[...] = jnp.zeros(a.shape, a.dtype)

    @pl.when(live & (g < E))
    def _step():
        if quantized:
            xe, xo = x_refs[0][...], x_refs[1][...]
            kh = bk // 2
            for i in range(n_w):
                p = w_refs[2 * i][...]
                sc = _select_scales(mx.scale_f32(w_refs[2 * i + 1][...]), k, bk // mx.GROUP, kh)
                lo, hi = mx.decode_lo_hi_f32(p)
                acc_refs[i][...] += (_dot_nt(xe, (lo * sc).astype(xe.dtype))
                                     + _dot_nt(xo, (hi * sc).astype(xo.dtype)))
        else:
            xb = x_refs[0][...]
            for i in range(n_w):
                acc_refs[i][...] += jnp.dot(xb, w_refs[i][...], preferred_element_type=jnp.float32)

    @pl.when(live & (k == n_k - 1))
    def _store():
        rows = blk_ref[t] * bm + jax.lax.broadcasted_iota(jnp.int32, (bm, 1), 0)
        in_group = (rows >= gstart_ref[g]) & (rows < gend_ref[g])
        accs = [a[...] for a in acc_refs]
        val = activation(*accs) if n_w == 2 else accs[0]
        val = jnp.where(g < E, val, 0.0).astype(o_ref.dtype)
        keep = jnp.where(first_ref[t] == 1, jnp.zeros(o_ref.shape, o_ref.dtype), o_ref[...])
        o_ref[...] = jnp.where(in_group, val, keep)


def grouped_matmul(x, weights, group_sizes, *, activation=None, out_dtype=jnp.float32,
                   config: TpuConfig | None = None, interpret: bool = False):
    """Same contract as `gpu.grouped_matmul`: `weights` = (W,) or (W_gate, W_up), dense `[E, K, N]` or MXFP4."""
    M, K = x.shape
    quantized = isinstance(weights[0], mx.MXFP4Weight)
    if quantized:
        E, N = weights[0].num_experts, weights[0].out_features
    else:
        E, _, N = weights[0].shape
    if M == 0:  # no rows: no tile to visit (the schedule would address row block -1)
        return jnp.zeros((0, N), out_dtype)
    cfg = config or TpuConfig()
    bm = cfg.bm if M >= cfg.bm else max(16, 1 << (max(M, 1) - 1).bit_length())
    bk = _fit(K, cfg.bk, 256 if quantized else 128)
    bn = _fit(N, cfg.bn, 128)
    n_k, n_n = K // bk, N // bn
    n_tiles = num_straddle_tiles_bound(cdiv(M, bm) * bm, E, bm)
    budget.check("MoE grouped matmul (TPU)", smem=budget.smem_bytes(n_tiles, n_tiles, n_tiles, E + 1, E + 1, 1),
                 vmem=vmem_bytes(bm, bk, bn, K, len(weights), x.dtype,
                                 None if quantized else weights[0].dtype, out_dtype, quantized))
    Mp = cdiv(M, bm) * bm
    if Mp != M:
        x = jnp.pad(x, ((0, Mp - M), (0, 0)))
    tiles = straddle_tiles(group_sizes, Mp, bm)
    T = tiles.group.shape[0]

    def wblk(n, t, k, grp, *_):
        return jnp.minimum(grp[t], E - 1)

    if quantized:
        kh = bk // 2
        xs = [x[:, 0::2], x[:, 1::2]]
        x_specs = [pl.BlockSpec((bm, kh), lambda n, t, k, grp, blk, *_: (blk[t], k))] * 2
        arrays, w_specs = [], []
        for w in weights:
            arrays += [w.packed, w.scale]
            w_specs += [pl.BlockSpec((pl.Squeezed(), bn, kh), lambda n, t, k, *s: (wblk(n, t, k, *s), n, k)),
                        pl.BlockSpec((pl.Squeezed(), bn, K // mx.GROUP),
                                     lambda n, t, k, *s: (wblk(n, t, k, *s), n, 0))]
    else:
        xs = [x]
        x_specs = [pl.BlockSpec((bm, bk), lambda n, t, k, grp, blk, *_: (blk[t], k))]
        arrays = list(weights)
        w_specs = [pl.BlockSpec((pl.Squeezed(), bk, bn), lambda n, t, k, *s: (wblk(n, t, k, *s), k, n))] * len(weights)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=6,
        grid=(n_n, T, n_k),
        in_specs=x_specs + w_specs,
        out_specs=pl.BlockSpec((bm, bn), lambda n, t, k, grp, blk, *_: (blk[t], n)),
        scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32) for _ in weights],
    )
    kernel = functools.partial(_kernel, E=E, bm=bm, bk=bk, n_k=n_k, quantized=quantized, n_w=len(weights),
                               activation=activation)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((Mp, N), out_dtype),
        grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="moe_grouped_matmul_tpu",
    )(tiles.group, tiles.m_block, tiles.first_visit, tiles.group_start, tiles.group_end, tiles.num_tiles,
      *xs, *arrays)
    return out[:M] if Mp != M else out
