"""GPU grouped matmul for MoE experts: a Pallas kernel lowered through Triton (CPU tests run it with interpret=True).

One program computes one (row tile, column block) of `out = x @ W[g]` for the tile's expert g. Tiles come from
`schedule.group_tiles`: a tile never straddles two experts, so the work is Σ_g ceil(rows_g / bm) tiles, with no
masked-out recomputation at group boundaries. The grid is flat, column blocks innermost: the programs in flight at
one time share the row tile (x stays in L2) and walk one expert's weight columns together, so each expert's weight
is read from HBM about once. Programs past the live tile count exit at once.

Row windows are clamped to [0, M) (`ws = min(row0, M - bm)`) and rows outside the tile's range are masked at the
store, so no load or store ever leaves the arrays and x needs no padding.

Options:
* Dense weights `[E, K, N]` (bf16) or MXFP4 (`MXFP4Weight`, packed `[E, N, K/2]` + E8M0 `[E, N, K/32]`): the packed
  tile is decoded in registers, never the whole weight — by default with inline PTX byte permutes straight to
  scaled bf16 (`mxfp4.DECODE_PTX`, < 2 integer ops per element; the interpreter runs its jnp twin), or with the
  older f16 bit trick (`dequant="2d"/"3d"`, `mxfp4.decode_lo_hi_f16`). x is split once (in XLA) into
  its even and odd input elements, so the nibbles need no interleaving: out += x_even @ W_lo^T + x_odd @ W_hi^T.
* `dequant="fp8"` (opt-in, measured slower): the codes shifted into e4m3 (`mxfp4.DECODE_E4M3_PTX`, < 1 integer op
  per element, no shuffles: a register of 4 codes is an fp8 wgmma fragment as it is), one fp8 wgmma per 32-element
  group and its E8M0 scale applied to that group's partial, x as two e4m3 planes. Fewer instructions than the bf16
  decode (491 vs 631 per 64 × 256 tile, pip Triton 3.6), but Triton waits for every one of those small wgmma
  before the next (only a loop-carried accumulator is pipelined): 0.82 vs 1.95 TB/s at 8 rows per expert.
* Two weights (gate, up) with `activation(g, u)` applied to the two fp32 accumulators before the single store:
  the gated FFN's first half in one kernel, h written once in bf16. On an H200 at K3 shapes this measured 0.92x
  two single-weight matmuls + the activation in XLA (two accumulators halve the column block that fits in
  registers), so `ops` does not fuse on GPU by default.
* `swap_ab`: compute outᵀ = W_tile · x_tileᵀ, putting the (small) row count on the MMA's N side — for decode, where
  an expert has only a handful of rows.

`mgpu_grouped_matmul` wraps JAX's bundled Mosaic GPU `ragged_dot_mgpu` (bf16, Hopper) as a second backend;
the choice between them is made by measurement (bench/moe.py) and recorded in `ops.GPU_CHOICE`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

import pallas_kernels.moe.mxfp4 as mx  # not `from . import`: see moe/ops.py

from ..triton_prims import fp8_dot_nt
from .schedule import group_tiles


try:  # the Triton lowering is deprecated in JAX 0.11 but present; keep this module importable without it
    from jax.experimental.pallas import triton as pltriton
except ImportError:  # pragma: no cover
    pltriton = None


def _triton_params(num_warps: int, num_stages: int):
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


@dataclasses.dataclass(frozen=True)
class GpuConfig:
    bm: int = 64  # rows per tile
    bn: int = 256  # output columns per program
    bk: int = 64  # contraction step
    num_warps: int = 8
    num_stages: int = 3
    swap_ab: bool = False
    # MXFP4 tile decode: "asm" (PTX byte permutes straight to scaled bf16, `mx.DECODE_PTX`), "asm_sign" (one
    # magnitude table + the sign bit ORed in, `mx.DECODE_PTX_SIGN`; 4% faster than "asm" on the H200),
    # "bf16" (the same numbers in jnp), "2d" (f16 bit trick, scales expanded to the tile), "3d" (as 2d, scales
    # broadcast [bn, bk/32, 16]), "fp8" (the codes as e4m3 on fp8 tensor cores, one dot per 32-element scale group,
    # x as two e4m3 planes: `_fp8_groups`; 2.4x slower than "asm_sign" on the H200)
    dequant: str = "asm_sign"
    # > 0: a tile holding at most bm_small rows (a group's last tile, or a small group) runs a bm_small-row MMA
    # instead of bm rows (a second code path in the same program, picked per tile at run time). At K3 prefill's
    # ~146 rows per expert, 128-row tiles compute 1.46x the rows and 128 + 64 mixed tiles 1.23x (bench/moe.py);
    # one launch, so a group's tiles still follow each other and share its weights through L2. H200:
    # 0.880 vs 0.915 ms (4%, not the 16% fewer rows: the 64-row wgmma path runs at a lower rate per row).
    bm_small: int = 0


# The decode used by `default_config` for MXFP4 weights: "asm_sign" (2026-12-01; H200 at 8 rows per
# expert: 1.93 TB/s vs 1.86 for "asm"); faster than "asm" and the older "2d" decode.
MXFP4_DECODE = "asm_sign"


def _pow2_at_least(v: float, lo: int, hi: int) -> int:
    b = lo
    while b < hi and b < v:
        b *= 2
    return b


def default_config(m_rows: int, num_groups: int, k: int, n: int, quantized: bool, n_w: int = 1) -> GpuConfig:
    """Block shapes by problem kind, from the H200 sweeps (2026-11-30, `bench/moe.py --sweep`).

    bf16, ~146 rows per expert (K3 prefill): 128x256x64 tiles, 8 warps, 3 stages (389 TFLOP/s; 64-row tiles, 128x128
    and deeper pipelines were slower), a group's last tile on a 64-row MMA when it holds ≤ 64 rows (`bm_small`:
    410 vs 395 TFLOP/s, 2026-12-01). Two weights (gate+up) hold two accumulators and two weight pipelines, so they
    get 128x128 tiles (the two-weight kernel measured 0.92x the two single matmuls; see `ops.FUSE_GATE_UP`).
    MXFP4: the tile decode, not the MMA or HBM, was the limit, so one row tile covers a whole decode-sized group
    (bm >= rows per expert, up to 64) and each weight tile is decoded once; 64x256 weight tiles, 4 warps (with the
    f16-trick "2d" decode: 1.34 TB/s at 8 rows per expert; 3d decode, wider/deeper tiles, 8 warps and swap_ab were
    slower). The decode is now `MXFP4_DECODE` (PTX byte permutes, ~4x fewer ops per element; block shapes re-swept
    on the H200: 16x64x256, 4 warps, 3 stages was still the best at 8 rows per expert; later:
    512-wide steps 3% faster there). The fp8 tensor-core path (`dequant="fp8"`) measured 2.4x slower: opt-in only."""
    avg = m_rows / max(num_groups, 1)
    if quantized:
        dq = MXFP4_DECODE
        if avg <= 16:  # 512-wide steps: 1.98 vs 1.92-1.95 TB/s at 8 rows per expert (H200)
            return GpuConfig(bm=16, bn=64, bk=512, num_warps=4, num_stages=3, dequant=dq)
        if avg <= 32:
            return GpuConfig(bm=32, bn=64, bk=256, num_warps=4, num_stages=3, dequant=dq)
        if avg <= 64:
            return GpuConfig(bm=64, bn=128, bk=128, num_warps=4, num_stages=3, dequant=dq)
        return GpuConfig(bm=128, bn=128 if n_w == 1 else 64, bk=128, num_warps=8, num_stages=3, dequant=dq)
    if avg <= 32:  # bf16 decode: 4.26 TB/s of weights at 8 rows per expert
        return GpuConfig(bm=_pow2_at_least(avg, 16, 32), bn=64, bk=128, num_warps=4, num_stages=4, swap_ab=True)
    if n_w == 2:
        return GpuConfig(bm=128, bn=128, bk=64, num_warps=8, num_stages=3)
    # a group's last tile of ≤ 64 rows on the 64-row path: 0.880 vs 0.915 ms at K3 prefill (H200)
    return GpuConfig(bm=128, bn=256, bk=64, num_warps=8, num_stages=3, bm_small=64)


def _pow2_divisor(dim: int, pref: int, floor: int) -> int:
    b = pref
    while b > floor and dim % b:
        b //= 2
    return b


def _dot_nt(a, b):  # a [m, k] · b [n, k]ᵀ -> [m, n] fp32
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _dot_nn(a, b):  # a [m, k] · b [k, n]
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _dot_tt(a, b):  # a [k, m]ᵀ · b [n, k]ᵀ -> [m, n]
    return jax.lax.dot_general(a, b, (((0,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _decode_tile(p_ref, s_ref, g, n0, kk, cfg: GpuConfig, dtype):
    """One expert's (bn, bk) weight tile from MXFP4, as (even, odd) element halves `[bn, bk/2]` in `dtype`."""
    bn, kh, ks = cfg.bn, cfg.bk // 2, cfg.bk // mx.GROUP
    sb = s_ref[g, pl.ds(n0, bn), pl.ds(kk * ks, ks)]
    if cfg.dequant in (*mx.PTX_DECODES, "bf16"):  # scaled bf16 from the codes; the interpreter runs the jnp twin
        pb = p_ref[g, pl.ds(n0, bn), pl.ds(pl.multiple_of(kk * kh, kh), kh)]
        h = mx.expand_scale(mx.scale_half_bf16(sb))
        if cfg.dequant in mx.PTX_DECODES:  # the PTX in Triton; its jnp twin (the same bits) in interpret mode
            lo, hi = mx.decode_lo_hi_bf16_asm(pb, h, cfg.dequant)
        else:
            lo, hi = mx.decode_lo_hi_bf16_ref(pb, h)
        return lo.astype(dtype), hi.astype(dtype)
    if cfg.dequant == "3d":  # packed viewed as [E, N, K/32, 16]: one scale per [.., 16] row, broadcast in registers
        pb = p_ref[g, pl.ds(n0, bn), pl.ds(kk * ks, ks), :]
        sc = mx.scale_f32(sb, mx.F16_TRICK_EXP)[:, :, None]
        lo, hi = mx.decode_lo_hi_f16(pb)
        return (lo * sc).astype(dtype).reshape(bn, kh), (hi * sc).astype(dtype).reshape(bn, kh)
    pb = p_ref[g, pl.ds(n0, bn), pl.ds(pl.multiple_of(kk * kh, kh), kh)]
    sc = mx.expand_scale(mx.scale_f32(sb, mx.F16_TRICK_EXP))
    lo, hi = mx.decode_lo_hi_f16(pb)
    return (lo * sc).astype(dtype), (hi * sc).astype(dtype)


def _fp8_groups(x_refs, p_ref, s_ref, acc, g, ws, n0, kk, BM: int, cfg: GpuConfig):
    """One contraction step of `dequant="fp8"`: for each 32-element group of the step, the weight codes as e4m3
    `[bn, 32]` — the group's 16 low-nibble (even) elements, then its 16 high-nibble (odd) ones, the order x's
    planes are stored in (`_fp8_x_planes`) — dotted on the fp8 tensor cores with x's hi and lo planes `[BM, 32]`
    (one accumulator), the partial `[bn, BM]` (swap_ab) or `[BM, bn]` times the group's E8M0 scale, added to `acc`."""
    bn, G = cfg.bn, mx.GROUP
    ng = cfg.bk // G
    sc_all = mx.scale_f32(s_ref[g, pl.ds(n0, bn), pl.ds(pl.multiple_of(kk * ng, ng), ng)], mx.E4M3_DECODE_EXP)
    scs = jnp.split(sc_all, ng, axis=1) if ng > 1 else [sc_all]
    for j in range(ng):
        kb = kk * ng + j  # the group's index along K
        pb = p_ref[g, pl.ds(n0, bn), pl.ds(pl.multiple_of(kb * (G // 2), G // 2), G // 2)]  # [bn, 16] uint8
        lo, hi = mx.decode_lo_hi_e4m3(pb)
        # [lo | hi] along the contraction: a register of 4 decoded codes is 4 consecutive operand elements
        w = jnp.transpose(jnp.stack([lo, hi], axis=-1), (0, 2, 1)).reshape(bn, G)
        xk = pl.ds(pl.multiple_of(kb * G, G), G)
        xh, xl = x_refs[0][pl.ds(ws, BM), xk], x_refs[1][pl.ds(ws, BM), xk]
        sc = scs[j]  # [bn, 1]
        if cfg.swap_ab:
            acc = acc + fp8_dot_nt(w, xl, fp8_dot_nt(w, xh)) * sc
        else:
            acc = acc + fp8_dot_nt(xl, w, fp8_dot_nt(xh, w)) * sc.reshape(1, bn)
    return acc


def _fp8_x_planes(x):
    """x `[M, K]` for `dequant="fp8"`: each 32-element group's even elements then its odd ones (the order of the
    decoded weight operand), as e4m3 planes hi, lo and each row's 1/scale (`mxfp4.split_e4m3_planes`)."""
    M, K = x.shape
    x = x.reshape(M, K // mx.GROUP, mx.GROUP // 2, 2).transpose(0, 1, 3, 2).reshape(M, K)
    return list(mx.split_e4m3_planes(x))


def _kernel(group_ref, row0_ref, rowend_ref, num_ref, *refs, cfg: GpuConfig, E: int, M: int, K: int,
            n_blocks: int, quantized: bool, n_w: int, activation, fill_uncovered: bool):
    o_ref = refs[-1]
    fp8 = quantized and cfg.dequant == "fp8"
    # MXFP4: x split into even / odd input elements; "fp8": x as e4m3 planes hi, lo and each row's 1/scale
    x_refs = refs[:3] if fp8 else refs[:2] if quantized else refs[:1]
    w_refs = refs[len(x_refs):-1]
    bm, bn, bk = cfg.bm, cfg.bn, cfg.bk
    pid = pl.program_id(0)
    t = pid // n_blocks
    n0 = pl.multiple_of((pid % n_blocks) * bn, bn)

    def tile(BM, g, r0, r1):
        """The tile's rows [r0, r1) through a BM-row window (the MMA's M side)."""
        ws = jnp.minimum(r0, M - BM)
        rows = ws + jnp.arange(BM, dtype=jnp.int32)
        rmask = (rows >= r0) & (rows < r1)
        out_mask = jnp.broadcast_to(rmask[:, None], (BM, bn))
        o_blk = o_ref.at[pl.ds(ws, BM), pl.ds(n0, bn)]
        acc_shape = (bn, BM) if cfg.swap_ab else (BM, bn)

        def step(kk, accs):
            new = []
            if fp8:
                for i in range(n_w):
                    new.append(_fp8_groups(x_refs, w_refs[2 * i], w_refs[2 * i + 1], accs[i], g, ws, n0, kk, BM,
                                           cfg))
            elif quantized:
                kh = bk // 2
                k0 = pl.multiple_of(kk * kh, kh)
                xe = x_refs[0][pl.ds(ws, BM), pl.ds(k0, kh)]
                xo = x_refs[1][pl.ds(ws, BM), pl.ds(k0, kh)]
                for i in range(n_w):
                    wl, wh = _decode_tile(w_refs[2 * i], w_refs[2 * i + 1], g, n0, kk, cfg, xe.dtype)
                    if cfg.swap_ab:
                        new.append(accs[i] + _dot_nt(wl, xe) + _dot_nt(wh, xo))
                    else:
                        new.append(accs[i] + _dot_nt(xe, wl) + _dot_nt(xo, wh))
            else:
                k0 = pl.multiple_of(kk * bk, bk)
                xb = x_refs[0][pl.ds(ws, BM), pl.ds(k0, bk)]
                for i in range(n_w):
                    wb = w_refs[i][g, pl.ds(k0, bk), pl.ds(n0, bn)]
                    new.append(accs[i] + (_dot_tt(wb, xb) if cfg.swap_ab else _dot_nn(xb, wb)))
            return tuple(new)

        @pl.when(g < E)
        def _compute():
            accs = tuple(jnp.zeros(acc_shape, jnp.float32) for _ in range(n_w))
            accs = jax.lax.fori_loop(0, K // bk, step, accs)
            if fp8:  # undo each row's power-of-two scale of x
                inv = x_refs[2][pl.ds(ws, BM)]
                accs = tuple(a * (inv[None, :] if cfg.swap_ab else inv[:, None]) for a in accs)
            out = activation(*accs) if n_w == 2 else accs[0]
            if cfg.swap_ab:
                out = out.T
            pltriton.store(o_blk, out.astype(o_ref.dtype), mask=out_mask)

        if fill_uncovered:
            @pl.when(g >= E)
            def _zeros():
                pltriton.store(o_blk, jnp.zeros((BM, bn), o_ref.dtype), mask=out_mask)

    @pl.when(t < num_ref[0])
    def _tile():
        g = group_ref[t]
        r0 = row0_ref[t]
        r1 = rowend_ref[t]
        if not cfg.bm_small:
            tile(bm, g, r0, r1)
            return
        small = r1 - r0 <= cfg.bm_small  # the tile's rows: min(r1 − r0, bm)

        @pl.when(small)
        def _small():
            tile(cfg.bm_small, g, r0, r1)

        @pl.when(jnp.logical_not(small))
        def _full():
            tile(bm, g, r0, r1)


def grouped_matmul(x, weights, group_sizes, *, activation=None, out_dtype=jnp.float32,
                   config: GpuConfig | None = None, interpret: bool = False, fill_uncovered: bool = True):
    """`x [M, K]` rows sorted by group; `weights` = (W,) or (W_gate, W_up), each dense `[E, K, N]` or MXFP4Weight.

    Returns `[M, N]` out_dtype: `x @ W[g]` per row (fp32 accumulation), or `activation(x @ Wg, x @ Wu)` for two
    weights. Rows past Σ group_sizes are zeros (or left unwritten with fill_uncovered=False).
    """
    M, K = x.shape
    quantized = isinstance(weights[0], mx.MXFP4Weight)
    if quantized:
        E, N = weights[0].num_experts, weights[0].out_features
        if weights[0].in_features != K:
            raise ValueError(f"MXFP4 weight has K={weights[0].in_features}, x has K={K}")
    else:
        E, K2, N = weights[0].shape
        if K2 != K:
            raise ValueError(f"weight [E, K, N] = {list(weights[0].shape)} does not match x [M, K] = {[M, K]}")
    cfg = config or default_config(M, E, K, N, quantized, len(weights))
    bk = _pow2_divisor(K, cfg.bk, 32 if quantized else 16)
    bn = _pow2_divisor(N, cfg.bn, 16)
    if K % bk or N % bn:
        raise ValueError(f"K={K} and N={N} must be multiples of 16 (K of 32 for MXFP4) for the GPU kernel")
    cfg = dataclasses.replace(cfg, bk=bk, bn=bn)
    if cfg.bm_small and not (16 <= cfg.bm_small < cfg.bm and cfg.bm_small & (cfg.bm_small - 1) == 0):
        raise ValueError(f"bm_small={cfg.bm_small} must be a power of two in [16, bm={cfg.bm})")
    pad_rows = max(cfg.bm - M, 0)  # tiny inputs: the row window must fit inside x
    if pad_rows:
        x = jnp.pad(x, ((0, pad_rows), (0, 0)))
    Mp = M + pad_rows
    tiles = group_tiles(group_sizes, M, cfg.bm)
    n_blocks = N // bn
    if quantized:  # even / odd input elements meet the low / high nibbles: no interleaving in the kernel
        xs = _fp8_x_planes(x) if cfg.dequant == "fp8" else [x[:, 0::2], x[:, 1::2]]
        arrays = []
        for w in weights:
            packed = w.packed.reshape(E, N, K // mx.GROUP, mx.GROUP // 2) if cfg.dequant == "3d" else w.packed
            arrays += [packed, w.scale]
    else:
        xs, arrays = [x], list(weights)
    kernel = functools.partial(_kernel, cfg=cfg, E=E, M=Mp, K=K, n_blocks=n_blocks, quantized=quantized,
                               n_w=len(weights), activation=activation, fill_uncovered=fill_uncovered)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((Mp, N), out_dtype),
        grid=(tiles.group.shape[0] * n_blocks,),
        compiler_params=_triton_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name="moe_grouped_matmul_q" if quantized else "moe_grouped_matmul",
    )(tiles.group, tiles.row0, tiles.row_end, tiles.num_tiles, *xs, *arrays)
    return out[:M] if pad_rows else out


# ----------------------------------------------------------------------------------------- JAX's Mosaic GPU kernel

@dataclasses.dataclass(frozen=True)
class MgpuConfig:
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    max_concurrent_steps: int = 4
    grid_block_n: int = 1


def mgpu_grouped_matmul(x, w, group_sizes, *, out_dtype=jnp.float32, config: MgpuConfig | None = None):
    """JAX's bundled Hopper kernel (`jax.experimental.pallas.ops.gpu.ragged_dot_mgpu`); bf16 dense weights only.
    Its output is in x's dtype; tiles that straddle groups are computed once per group."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    c = config or MgpuConfig()
    out = ragged_dot_mgpu.ragged_dot(x, w.astype(x.dtype), group_sizes=group_sizes.astype(jnp.int32),
                                     block_m=c.block_m, block_n=c.block_n, block_k=c.block_k,
                                     max_concurrent_steps=c.max_concurrent_steps, grid_block_n=c.grid_block_n)
    return out.astype(out_dtype)
