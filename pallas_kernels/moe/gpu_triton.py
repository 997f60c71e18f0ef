"""Native Triton GPU grouped matmul for MoE experts (launched through jax-triton; CPU tests: Triton's interpreter).

The algorithm of the Pallas Triton kernel `gpu.py` (its docstring has the story): `out = x @ W[g]` per row tile of
one expert, tiles from `schedule.group_tiles` (never straddling two experts), a flat grid with the column blocks
innermost so the programs in flight share a row tile and walk one expert's weight together, row windows clamped to
[0, M) and masked at the store, a tile of ≤ `bm_small` rows on a shorter MMA, `swap_ab` for decode-sized groups.
It takes the same `GpuConfig` (and `gpu.default_config`). Reference: `reference.grouped_matmul` (ragged_dot) on the
exactly dequantised weights.

What differs:
- MXFP4 tiles: on NVIDIA targets the Pallas kernel's PTX decode (`GpuConfig.dequant` "asm_sign", the default, or
  "asm": `mxfp4.PTX_DECODES`, byte permutes straight to scaled bf16) through `tl.inline_asm_elementwise`; elsewhere
  (ROCm, the interpreter, any other `dequant`) by arithmetic (`triton_codec.e2m1_value` × the E8M0 scale, to bf16).
  Both are exact, so the two paths give the same tile. The choice is made at compile time (`triton_call.ON_NVIDIA`).
  The fp8 tensor-core path (`dequant="fp8"`, measured slower) is not ported.
- One weight per launch: two weights (gate, up) run as two launches with the activation in XLA — on the H200 the
  fused two-weight kernel measured 0.92× that (`ops.FUSE_GATE_UP` is off on GPU).
- Expert offsets are int64, so weights past 2^31 elements need nothing special.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

import pallas_kernels.moe.mxfp4 as mx  # not `from . import`: see moe/ops.py

from ..triton_call import available as _launcher_available
from ..triton_call import ON_NVIDIA, call, jit, tl
from ..triton_codec import e2m1_value, e8m0_value
from .gpu import GpuConfig, _pow2_divisor, default_config
from .schedule import group_tiles

__all__ = ["GpuConfig", "available", "default_config", "grouped_matmul"]


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
    (exact) through the PTX of `mxfp4.PTX_DECODES` (4 bytes per asm invocation, as in the Pallas kernel)."""
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
        # int64 expert bases, int32 offsets inside one expert (as the Pallas kernel): with int64 offset tensors ptxas
        # gave the 16 x 64 x 512 tile 255 registers instead of 171 (K3 shapes, sm_90; the Pallas kernel: 168)
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
            if DECODE > 0:  # PTX: the group's scale broadcast in registers, as the Pallas kernel does
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
    """As `gpu.grouped_matmul`: `x [M, K]` rows sorted by group; `weights` = (W,) or (W_gate, W_up), each dense
    `[E, K, N]` (bf16) or `MXFP4Weight`. Returns `[M, N]` out_dtype: `x @ W[g]` per row (fp32 accumulation), or
    `activation(x @ Wg, x @ Wu)` (fp32, in XLA) for two weights. Rows past Σ group_sizes are zeros (or left unwritten
    with fill_uncovered=False)."""
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
    if len(weights) == 1:
        return _one_weight(x, weights[0], group_sizes, out_dtype=out_dtype, cfg=cfg, interpret=interpret,
                           fill_uncovered=fill_uncovered)
    outs = [_one_weight(x, w, group_sizes, out_dtype=jnp.float32, cfg=cfg, interpret=interpret,
                        fill_uncovered=True) for w in weights]
    return activation(*outs).astype(out_dtype)
