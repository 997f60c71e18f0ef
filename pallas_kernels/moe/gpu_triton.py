"""GPU grouped matmul for MoE experts in native Triton (launched through jax-triton; CPU tests: Triton's interpreter).

One program computes one (row tile, column block) of `out = x @ W[g]` for the tile's expert g. Tiles come from
`schedule.group_tiles`: a tile never straddles two experts, so the work is Σ_g ceil(rows_g / bm) tiles, with no
masked-out recomputation at group boundaries. The grid is flat, column blocks innermost: the programs in flight at
one time share the row tile (x stays in L2) and walk one expert's weight columns together, so each expert's weight
is read from HBM about once. Programs past the live tile count exit at once. Row windows are clamped to [0, M)
(`ws = min(row0, M - bm)`) and rows outside the tile's range are masked at the store, so no load or store leaves
the arrays; expert offsets are int64, so weights past 2^31 elements need nothing special.
Reference: `reference.grouped_matmul` (ragged_dot) on the exactly dequantised weights.

Options (`GpuConfig`; `default_config` picks measured shapes):
* Dense weights `[E, K, N]` (bf16) or MXFP4 (`MXFP4Weight`, packed `[E, N, K/2]` + E8M0 `[E, N, K/32]`): the packed
  tile is decoded in registers, never the whole weight. x is split once (in XLA) into its even and odd input
  elements, so the nibbles need no interleaving: out += x_even @ W_lo^T + x_odd @ W_hi^T. On NVIDIA targets the
  decode is inline PTX (`dequant` "asm_sign", the default, or "asm": `mxfp4.PTX_DECODES`, byte permutes straight to
  scaled bf16, < 2 integer ops per element) through `tl.inline_asm_elementwise`; elsewhere (ROCm, the interpreter,
  `dequant="bf16"`) by arithmetic (`triton_codec.e2m1_value` × the E8M0 scale, to bf16). Both are exact, so the two
  paths give the same tile. The choice is made at compile time (`triton_call.ON_NVIDIA`).
* `bm_small`: a tile of ≤ bm_small rows (a group's last tile, a small group) runs a shorter MMA in the same program.
* `swap_ab`: compute outᵀ = W_tile · x_tileᵀ, putting the (small) row count on the MMA's N side — for decode, where
  an expert has only a handful of rows.
* Two weights (gate, up) run as two launches with the activation in XLA: on the H200 a fused two-weight kernel
  measured 0.92× that (two accumulators halve the column block that fits in registers; `ops.FUSE_GATE_UP` is off
  on GPU).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

import pallas_kernels.moe.mxfp4 as mx  # not `from . import`: see moe/ops.py

from ..triton_call import available as _launcher_available
from ..triton_call import ON_NVIDIA, call, jit, tl
from ..triton_codec import e2m1_value, e8m0_value
from .schedule import group_tiles

__all__ = ["DEQUANTS", "GpuConfig", "available", "default_config", "grouped_matmul"]

DEQUANTS = ("asm_sign", "asm", "bf16")  # the MXFP4 tile decodes (`GpuConfig.dequant`)


@dataclasses.dataclass(frozen=True)
class GpuConfig:
    bm: int = 64  # rows per tile
    bn: int = 256  # output columns per program
    bk: int = 64  # contraction step
    num_warps: int = 8
    num_stages: int = 3
    swap_ab: bool = False
    # MXFP4 tile decode on NVIDIA targets: "asm" (PTX byte permutes straight to scaled bf16, `mx.DECODE_PTX`),
    # "asm_sign" (one magnitude table + the sign bit ORed in, `mx.DECODE_PTX_SIGN`; 4% faster than "asm" on the
    # H200), "bf16" (the same numbers by arithmetic, as on every other target)
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


def _pow2_in(v: float, lo: int, hi: int) -> int:
    """The smallest power of two ≥ v in [lo, hi] (lo and hi powers of two)."""
    b = lo
    while b < hi and b < v:
        b *= 2
    return b


def default_config(m_rows: int, num_groups: int, k: int, n: int, quantized: bool, n_w: int = 1) -> GpuConfig:
    """Block shapes by problem kind, from the H200 sweeps (`bench/moe.py --sweep`, run on the Pallas Triton kernel
    this one replaced, issue #48; docs/performance.md has the native kernel's figures).

    bf16, ~146 rows per expert (K3 prefill): 128x256x64 tiles, 8 warps, 3 stages (389 TFLOP/s; 64-row tiles, 128x128
    and deeper pipelines were slower), a group's last tile on a 64-row MMA when it holds ≤ 64 rows (`bm_small`:
    410 vs 395 TFLOP/s, 2026-12-01). Two weights (gate+up) hold two accumulators and two weight pipelines, so they
    get 128x128 tiles (the two-weight kernel measured 0.92x the two single matmuls; see `ops.FUSE_GATE_UP`).
    MXFP4: the tile decode, not the MMA or HBM, was the limit, so one row tile covers a whole decode-sized group
    (bm >= rows per expert, up to 64) and each weight tile is decoded once; 64x256 weight tiles, 4 warps (with the
    f16-trick "2d" decode: 1.34 TB/s at 8 rows per expert; 3d decode, wider/deeper tiles, 8 warps and swap_ab were
    slower). The decode is now `MXFP4_DECODE` (PTX byte permutes, ~4x fewer ops per element; block shapes re-swept
    on the H200: 16x64x256, 4 warps, 3 stages was still the best at 8 rows per expert; later:
    512-wide steps 3% faster there). An fp8 tensor-core path (the codes shifted into e4m3) measured 2.4x slower and
    was dropped."""
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
        return GpuConfig(bm=_pow2_in(avg, 16, 32), bn=64, bk=128, num_warps=4, num_stages=4, swap_ab=True)
    if n_w == 2:
        return GpuConfig(bm=128, bn=128, bk=64, num_warps=8, num_stages=3)
    # a group's last tile of ≤ 64 rows on the 64-row path: 0.880 vs 0.915 ms at K3 prefill (H200)
    return GpuConfig(bm=128, bn=256, bk=64, num_warps=8, num_stages=3, bm_small=64)


def _pow2_divisor(dim: int, pref: int, floor: int) -> int:
    b = pref
    while b > floor and dim % b:
        b //= 2
    return b


def available() -> bool:
    return _launcher_available()


# The PTX decodes as Triton constexprs (a @jit function reads only constexpr globals); DECODE codes: 0 arithmetic.
PTX_DECODE_CODE = {"asm": 1, "asm_sign": 2}
if tl is not None:
    _PTX_ASM = tl.constexpr(mx.PTX_DECODES["asm"])
    _PTX_ASM_SIGN = tl.constexpr(mx.PTX_DECODES["asm_sign"])


@jit
def _decode_ptx(packed, h, DECODE: tl.constexpr):
    """Packed bytes `[BN, KH]` uint8 and h = 2^(S−128) bf16 of the same shape -> (lo, hi) bf16 e2m1 · 2^(S−127)
    (exact) through the PTX of `mxfp4.PTX_DECODES` (4 bytes per asm invocation)."""
    if DECODE == 1:
        lo, hi = tl.inline_asm_elementwise(_PTX_ASM, "=r,=r,=r,=r,r,r,r", [packed, h],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        lo, hi = tl.inline_asm_elementwise(_PTX_ASM_SIGN, "=r,=r,=r,=r,r,r,r", [packed, h],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    return lo, hi


@jit
def _half_scale_bf16(s_u8):
    """E8M0 codes -> bf16 h = 2^(S−128) from the exponent bits, S ≤ 1 -> 0 (`mxfp4.scale_half_bf16`)."""
    e = tl.maximum(s_u8.to(tl.int32), 1) - 1
    return (e << 7).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@jit
def _tile(x_ptr, x2_ptr, w_ptr, s_ptr, o_ptr, g, r0, r1, n0,
          M: tl.constexpr, K: tl.constexpr, N: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
          QUANT: tl.constexpr, SWAP_AB: tl.constexpr, DECODE: tl.constexpr):
    """Rows [r0, r1) of expert g, columns [n0, n0 + BN), through a BM-row window (the MMA's M side)."""
    ws = tl.minimum(r0, M - BM)
    rows = ws + tl.arange(0, BM)
    cols = n0 + tl.arange(0, BN)
    if SWAP_AB:
        acc = tl.zeros([BN, BM], tl.float32)
    else:
        acc = tl.zeros([BM, BN], tl.float32)
    if QUANT:
        KH: tl.constexpr = BK // 2
        kh = tl.arange(0, KH)
        # int64 expert bases, int32 offsets inside one expert: with int64 offset tensors ptxas gave the 16 x 64 x 512
        # tile 255 registers instead of 171 (K3 shapes, sm_90)
        w_e = w_ptr + g.to(tl.int64) * (N * (K // 2))
        s_e = s_ptr + g.to(tl.int64) * (N * (K // 32))
        w_off = cols[:, None] * (K // 2) + kh[None, :]  # [BN, BK/2]
        if M * (K // 2) < 2**31:
            x_off = rows[:, None] * (K // 2) + kh[None, :]  # [BM, BK/2]
        else:
            x_off = rows[:, None].to(tl.int64) * (K // 2) + kh[None, :]
        for kk in range(0, K // BK):
            xe = tl.load(x_ptr + (x_off + kk * KH))  # [BM, BK/2] even input elements
            xo = tl.load(x2_ptr + (x_off + kk * KH))  # odd ones
            if DECODE > 0:  # PTX: the group's scale broadcast in registers
                packed = tl.load(w_e + (w_off + kk * KH))  # [BN, BK/2] uint8
                sg = cols[:, None] * (K // 32) + kk * (BK // 32) + tl.arange(0, BK // 32)[None, :]
                h = _half_scale_bf16(tl.load(s_e + sg))  # [BN, BK/32]
                h = tl.reshape(tl.broadcast_to(h[:, :, None], (BN, BK // 32, 16)), (BN, KH))
                lo, hi = _decode_ptx(packed, h, DECODE)
            else:
                packed = tl.load(w_e + (w_off + kk * KH)).to(tl.int32)  # [BN, BK/2]
                sg = cols[:, None] * (K // 32) + kk * (BK // 32) + kh[None, :] // 16
                scale = e8m0_value(tl.load(s_e + sg).to(tl.int32))
                lo = (e2m1_value(packed & 0xF) * scale).to(xe.dtype)  # elements 2j (exact in bf16)
                hi = (e2m1_value(packed >> 4) * scale).to(xe.dtype)  # elements 2j + 1
            if SWAP_AB:
                acc += tl.dot(lo, tl.trans(xe))
                acc += tl.dot(hi, tl.trans(xo))
            else:
                acc += tl.dot(xe, tl.trans(lo))
                acc += tl.dot(xo, tl.trans(hi))
    else:
        rk = tl.arange(0, BK)
        w_tile = w_ptr + g.to(tl.int64) * K * N + rk[:, None] * N + cols[None, :]  # [BK, BN]
        x_tile = x_ptr + rows[:, None].to(tl.int64) * K + rk[None, :]  # [BM, BK]
        for kk in range(0, K // BK):
            xb = tl.load(x_tile + kk * BK)
            wb = tl.load(w_tile + kk * BK * N)
            if SWAP_AB:
                acc += tl.dot(tl.trans(wb), tl.trans(xb))
            else:
                acc += tl.dot(xb, wb)
    if SWAP_AB:
        out = tl.trans(acc)
    else:
        out = acc
    live = (rows >= r0) & (rows < r1)
    o_tile = o_ptr + rows[:, None].to(tl.int64) * N + cols[None, :]
    tl.store(o_tile, out.to(o_ptr.dtype.element_ty), mask=live[:, None])


@jit
def _zero_tile(o_ptr, r0, r1, n0, M: tl.constexpr, N: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    ws = tl.minimum(r0, M - BM)
    rows = ws + tl.arange(0, BM)
    cols = n0 + tl.arange(0, BN)
    live = (rows >= r0) & (rows < r1)
    tl.store(o_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], tl.zeros([BM, BN], o_ptr.dtype.element_ty),
             mask=live[:, None])


@jit
def _gmm_kernel(group_ptr, row0_ptr, rowend_ptr, num_ptr, x_ptr, x2_ptr, w_ptr, s_ptr, o_ptr,
                E: tl.constexpr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr, BM: tl.constexpr,
                BN: tl.constexpr, BK: tl.constexpr, BM_SMALL: tl.constexpr, N_BLOCKS: tl.constexpr,
                QUANT: tl.constexpr, SWAP_AB: tl.constexpr, FILL: tl.constexpr, NV: tl.constexpr,
                DECODE: tl.constexpr):
    """Program pid: tile pid // N_BLOCKS of the schedule (group, first row, group end), column block pid % N_BLOCKS.
    x `[M, K]` (MXFP4: x even / odd elements `[M, K/2]` each), W `[E, K, N]` or packed `[E, N, K/2]` + E8M0
    `[E, N, K/32]`, out `[M, N]`. Tiles past the schedule's count do nothing; the uncovered rows' pseudo-group
    (g = E) is written zeros when FILL. NV: compiled for an NVIDIA GPU; DECODE: `PTX_DECODE_CODE` of the PTX
    decode to use there (0: arithmetic everywhere)."""
    PTX: tl.constexpr = DECODE if NV else 0
    pid = tl.program_id(0)
    t = pid // N_BLOCKS
    n0 = (pid % N_BLOCKS) * BN
    if t < tl.load(num_ptr):
        g = tl.load(group_ptr + t)
        r0 = tl.load(row0_ptr + t)
        r1 = tl.load(rowend_ptr + t)
        if g < E:
            if BM_SMALL > 0:
                if r1 - r0 <= BM_SMALL:
                    _tile(x_ptr, x2_ptr, w_ptr, s_ptr, o_ptr, g, r0, r1, n0, M, K, N, BM_SMALL, BN, BK, QUANT,
                          SWAP_AB, PTX)
                else:
                    _tile(x_ptr, x2_ptr, w_ptr, s_ptr, o_ptr, g, r0, r1, n0, M, K, N, BM, BN, BK, QUANT, SWAP_AB,
                          PTX)
            else:
                _tile(x_ptr, x2_ptr, w_ptr, s_ptr, o_ptr, g, r0, r1, n0, M, K, N, BM, BN, BK, QUANT, SWAP_AB, PTX)
        elif FILL:
            _zero_tile(o_ptr, r0, r1, n0, M, N, BM, BN)


def _one_weight(x, w, group_sizes, *, out_dtype, cfg: GpuConfig, interpret: bool, fill_uncovered: bool):
    M, K = x.shape
    quantized = isinstance(w, mx.MXFP4Weight)
    E, N = (w.num_experts, w.out_features) if quantized else (w.shape[0], w.shape[2])
    pad_rows = max(cfg.bm - M, 0)  # tiny inputs: the row window must fit inside x
    if pad_rows:
        x = jnp.pad(x, ((0, pad_rows), (0, 0)))
    Mp = M + pad_rows
    tiles = group_tiles(group_sizes, M, cfg.bm)
    n_blocks = N // cfg.bn
    if quantized:  # even / odd input elements meet the low / high nibbles: no interleaving in the kernel
        arrays = [x[:, 0::2], x[:, 1::2], w.packed, w.scale]
    else:
        arrays = [x, x, w, w]  # the second x and the scale pointer are not read
    out = call(tiles.group, tiles.row0, tiles.row_end, tiles.num_tiles, *arrays,
               kernel=_gmm_kernel, out_shape=jax.ShapeDtypeStruct((Mp, N), out_dtype),
               grid=(tiles.group.shape[0] * n_blocks,), interpret=interpret, num_warps=cfg.num_warps,
               num_stages=cfg.num_stages, name="moe_grouped_matmul_triton",
               E=E, M=Mp, K=K, N=N, BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, BM_SMALL=cfg.bm_small, N_BLOCKS=n_blocks,
               QUANT=quantized, SWAP_AB=cfg.swap_ab, FILL=fill_uncovered, NV=ON_NVIDIA,
               DECODE=PTX_DECODE_CODE.get(cfg.dequant, 0) if quantized else 0)
    return out[:M] if pad_rows else out


def grouped_matmul(x, weights, group_sizes, *, activation=None, out_dtype=jnp.float32,
                   config: GpuConfig | None = None, interpret: bool = False, fill_uncovered: bool = True):
    """`x [M, K]` rows sorted by group; `weights` = (W,) or (W_gate, W_up), each dense `[E, K, N]` (bf16) or
    `MXFP4Weight`; group_sizes `[E]`. Returns `[M, N]` out_dtype: `x @ W[g]` per row (fp32 accumulation), or
    `activation(x @ Wg, x @ Wu)` (fp32, in XLA) for two weights. Rows past Σ group_sizes are zeros (or left
    unwritten with fill_uncovered=False). `config`: block shapes (None: `default_config`); `interpret`: Triton's
    interpreter on the host."""
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
    if cfg.dequant not in DEQUANTS:
        raise ValueError(f"GpuConfig.dequant must be one of {DEQUANTS}, got {cfg.dequant!r}")
    bk = _pow2_divisor(K, cfg.bk, 32 if quantized else 16)
    bn = _pow2_divisor(N, cfg.bn, 16)
    if K % bk or N % bn:
        raise ValueError(f"K={K} and N={N} must be multiples of 16 (K of 32 for MXFP4) for the GPU kernel")
    cfg = dataclasses.replace(cfg, bk=bk, bn=bn)
    if cfg.bm_small and not (16 <= cfg.bm_small < cfg.bm and cfg.bm_small & (cfg.bm_small - 1) == 0):
        raise ValueError(f"bm_small={cfg.bm_small} must be a power of two in [16, bm={cfg.bm})")
    if len(weights) == 1:
        return _one_weight(x, weights[0], group_sizes, out_dtype=out_dtype, cfg=cfg, interpret=interpret,
                           fill_uncovered=fill_uncovered)
    outs = [_one_weight(x, w, group_sizes, out_dtype=jnp.float32, cfg=cfg, interpret=interpret,
                        fill_uncovered=True) for w in weights]
    return activation(*outs).astype(out_dtype)
