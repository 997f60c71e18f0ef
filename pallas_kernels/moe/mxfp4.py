"""MXFP4 expert weights (docs/model.md §7) as the kernels take them, and their exact jnp decoding.

Layout (torch `[out, in]` orientation, as stored in the checkpoint): `packed` uint8 `[E, N, K/2]`, two e2m1 codes per
byte, the LOW nibble holding the even input element; `scale` uint8 E8M0 `[E, N, K/32]`, value = e2m1 · 2^(s − 127).
Here K is the matmul's contraction (the layer's input width) and N its output width, so one expert computes
`y[m, n] = Σ_k x[m, k] · W[n, k]`.

Two decodings live here:
* `dequantize` — exact, table-based, whole tensor: the definition, used by the reference backend and the tests.
* `decode_lo_hi_f16` / `decode_lo_hi_f32` — what the kernels run on one tile of packed bytes. The f16 form builds
  the code's bits straight into a half-precision number (the e=0 codes become f16 subnormals, which conversion
  to f32 keeps exactly) and folds the 2^14 it is off by into the scale: ~8 integer/float ops per element. The f32
  form uses only int32/f32 arithmetic and selects (no f16 on the vector unit), for Mosaic TPU.
Scales: 2^(s−127) is built from the bits `s << 23`; that is exact for s ∈ [1, 254]. s = 0 (2^−127, a subnormal)
decodes as 0 and s = 255 (NaN) as inf in the kernels; both are absent from real checkpoints.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels.codec as codec
from ..codec import E2M1_VALUES, e2m1_value
from ..codec import MXFP4_GROUP as GROUP  # elements per E8M0 scale


class MXFP4Weight(NamedTuple):
    """A stack of MXFP4 expert matrices: packed `[E, N, K/2]` uint8 and scale `[E, N, K/32]` uint8 (E8M0)."""

    packed: jax.Array
    scale: jax.Array

    @property
    def num_experts(self) -> int:
        return self.packed.shape[0]

    @property
    def in_features(self) -> int:  # K
        return self.packed.shape[-1] * 2

    @property
    def out_features(self) -> int:  # N
        return self.packed.shape[-2]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.packed.shape)) + int(np.prod(self.scale.shape))


def as_mxfp4(w, w_scale=None):
    """`MXFP4Weight` from (packed, scale), a pair, or an existing `MXFP4Weight`; None when `w` is a dense array."""
    if isinstance(w, MXFP4Weight):
        return w
    if isinstance(w, (tuple, list)):
        if len(w) != 2:
            raise ValueError(f"an MXFP4 weight is a (packed, scale) pair, got {len(w)} arrays")
        w, w_scale = w
    if w_scale is None:
        if jnp.dtype(w.dtype) == jnp.uint8:
            raise ValueError("uint8 weights are MXFP4 packed codes and need w_scale (E8M0, [E, N, K/32])")
        return None
    E, N, K2 = w.shape
    if jnp.dtype(w.dtype) != jnp.uint8 or jnp.dtype(w_scale.dtype) != jnp.uint8:
        raise ValueError(f"MXFP4 packed and scale must be uint8, got {w.dtype} and {w_scale.dtype}")
    if tuple(w_scale.shape) != (E, N, 2 * K2 // GROUP) or (2 * K2) % GROUP:
        raise ValueError(f"MXFP4 tensors do not fit: packed {list(w.shape)} (expected [E, N, K/2]) and scale "
                         f"{list(w_scale.shape)} (expected [E, N, K/{GROUP}] = {[E, N, 2 * K2 // GROUP]})")
    return MXFP4Weight(w, w_scale)


@functools.partial(jax.jit, static_argnames="dtype")
def dequantize(w: MXFP4Weight, dtype=jnp.float32):
    """Exact decoding (`codec.mxfp4_dequantize`) to `[E, K, N]` (the orientation of dense expert weights). Whole
    tensor: reference only."""
    return jnp.swapaxes(codec.mxfp4_dequantize(w.packed, w.scale), -1, -2).astype(dtype)


def quantize(w_ekn) -> MXFP4Weight:
    """Quantise dense `[E, K, N]` weights to MXFP4 (NumPy, `codec.mxfp4_quantize_np`; tests and benches)."""
    packed, scale = codec.mxfp4_quantize_np(np.swapaxes(np.asarray(w_ekn, np.float32), -1, -2))
    return MXFP4Weight(jnp.asarray(packed), jnp.asarray(scale))


# ----------------------------------------------------------------------------------------------- in-kernel decoding

def scale_f32(s_u8, extra_exp: int = 0):
    """E8M0 codes -> float32 2^(s−127+extra_exp) from the exponent bits: exact while s + extra_exp ∈ [1, 254];
    s + extra_exp = 0 gives 0, above 254 inf or NaN (extra_exp ≥ 0; no real checkpoint holds s ≥ 249)."""
    return jax.lax.bitcast_convert_type((s_u8.astype(jnp.int32) + extra_exp) << 23, jnp.float32)


def expand_scale(s_f32, per: int = GROUP // 2):
    """`[bn, g]` scales -> `[bn, g·per]`: each scale covers `per` bytes (= 32 elements, 16 of each nibble)."""
    bn, g = s_f32.shape
    return jnp.broadcast_to(s_f32[:, :, None], (bn, g, per)).reshape(bn, g * per)


def decode_lo_hi_f16(p_u8):
    """Packed bytes -> (even, odd) element values · 2^−14 as float32, via f16 bit patterns (GPU kernels)."""
    p = p_u8.astype(jnp.uint16)
    lo = ((p & 0x07) << 9) | ((p & 0x08) << 12)
    hi = ((p & 0x70) << 5) | ((p & 0x80) << 8)
    f16 = lambda b: jax.lax.bitcast_convert_type(b, jnp.float16).astype(jnp.float32)  # noqa: E731
    return f16(lo), f16(hi)


F16_TRICK_EXP = 14  # decode_lo_hi_f16 values are 2^−14 times the e2m1 value


def decode_lo_hi_f32(p_u8):
    """Packed bytes -> (even, odd) e2m1 values as float32 with int32/f32 ops and selects (TPU kernels)."""
    p = p_u8.astype(jnp.int32)
    return e2m1_value(p & 0x0F), e2m1_value(p >> 4)


# ------------------------------------------------------------------------- fast GPU decode: byte permutes in PTX
# Why: the jnp decode above costs ~8 integer/float ops per element in Triton plus f32 round trips; at decode-sized
# groups that, not HBM, bounds the MXFP4 grouped matmul (`bench/moe.py`). The PTX below turns one 32-bit word of
# packed codes (8 elements) into four bf16x2 registers, already scaled, in 15 integer ops (and, shr, prmt, lop3) and
# 6 bf16x2 FMAs — under 2 integer ops per element:
#   1. a 16-entry signed lookup through `prmt` (a byte permute whose selector nibbles are the codes): bytes
#      q = 64 + 2·v for the e2m1 value v (two 8-entry pools for ±, picked per byte by the sign bit, which prmt's
#      sign-replicate mode turns into a 0x80 / 0xFF byte mask for `lop3`);
#   2. a second `prmt` places q under the byte 0x43: the bf16 bits 0x43qq are exactly 128 + q = 192 + 2·v;
#   3. one `fma.rn.bf16x2`: (192 + 2·v)·h − 192·h with h = 2^(S−128) (half the E8M0 scale) = v·2^(S−127), exact
#      (v·2^(S−127) has at most 2 significant bits), with h and −192·h from the scale operand.
# Outputs follow the jnp decoders: `lo` = low nibbles (even input elements), `hi` = high nibbles (odd).
# Limits: E8M0 codes S ≤ 1 decode as 0 (as `scale_f32` does for 0) and S ≥ 249 overflow; real checkpoints hold
# neither. The same numbers in jnp (`decode_lo_hi_bf16_ref`) serve the interpreter and the tests; a NumPy model of
# the exact instruction sequence (tests/test_moe_kernels.py) checks the tables and selectors below.

LUT_POS = (0x43424140, 0x4C484644)  # bytes 64 + 2·|v| for codes 0..7 (|v| = 0, .5, 1, 1.5, 2, 3, 4, 6)
LUT_NEG = (0x3D3E3F40, 0x34383A3C)  # bytes 64 − 2·|v|
SEL_LO, SEL_HI = 0x4240, 0x4341  # [q(lo0), 0x43, q(lo1), 0x43] and [q(hi0), 0x43, q(hi1), 0x43]
BF16X2_M192 = 0xC340C340  # (−192, −192)

# Steps 2 and 3, shared by both decodes: bytes q (in d4q / d4qh) under 0x43, then (192 + 2·v)·h − 192·h.
_PLACE_AND_SCALE = f"""fma.rn.bf16x2 d4c01, $5, d4k, d4z;
fma.rn.bf16x2 d4c23, $6, d4k, d4z;
prmt.b32 $0, d4q, d4c43, {SEL_LO:#06x};
prmt.b32 $1, d4qh, d4c43, {SEL_LO:#06x};
prmt.b32 $2, d4q, d4c43, {SEL_HI:#06x};
prmt.b32 $3, d4qh, d4c43, {SEL_HI:#06x};
fma.rn.bf16x2 $0, $0, $5, d4c01;
fma.rn.bf16x2 $1, $1, $6, d4c23;
fma.rn.bf16x2 $2, $2, $5, d4c01;
fma.rn.bf16x2 $3, $3, $6, d4c23;
"""

DECODE_PTX = f"""{{
.reg .b32 d4pa, d4pb, d4na, d4nb, d4c80, d4c43, d4k, d4z, d4m, d4mh, d4wh, d4p, d4n, d4sg, d4q, d4qh, d4c01, d4c23;
mov.b32 d4pa, {LUT_POS[0]:#010x};
mov.b32 d4pb, {LUT_POS[1]:#010x};
mov.b32 d4na, {LUT_NEG[0]:#010x};
mov.b32 d4nb, {LUT_NEG[1]:#010x};
mov.b32 d4c80, 0x80808080;
mov.b32 d4c43, 0x43434343;
mov.b32 d4k, {BF16X2_M192:#010x};
mov.b32 d4z, 0;
and.b32 d4m, $4, 0x77777777;
shr.u32 d4wh, $4, 16;
shr.u32 d4mh, d4m, 16;
prmt.b32 d4p, d4pa, d4pb, d4m;
prmt.b32 d4n, d4na, d4nb, d4m;
prmt.b32 d4sg, d4c80, d4c80, $4;
lop3.b32 d4q, d4p, d4n, d4sg, 0xD8;
prmt.b32 d4p, d4pa, d4pb, d4mh;
prmt.b32 d4n, d4na, d4nb, d4mh;
prmt.b32 d4sg, d4c80, d4c80, d4wh;
lop3.b32 d4qh, d4p, d4n, d4sg, 0xD8;
{_PLACE_AND_SCALE}}}"""


# A variant (GpuConfig.dequant="asm_sign", the default: 4% faster than DECODE_PTX on the H200 at 8
# rows per expert, 1.93 vs 1.86 TB/s of weights): one positive-magnitude
# table instead of the signed pair, and the sign ORed into each bf16 lane afterwards from the code bytes (placed by
# a byte permute under bits 15/31; a 4-bit shift brings the low nibbles' sign bits there). Same 21 working
# instructions per 8 elements but six table/mask words instead of eight; in the SASS of the (Pallas Triton) kernel
# ptxas' uniform-register constant copies fall from 96 to 25 and the kernel from 952 to 880 SASS instructions (143
# registers instead of 128). ncu showed the "asm" kernel issue-bound with ~25% of its instructions such copies. Code
# 8 (−0) decodes to −0 here (to +0 in DECODE_PTX); products and sums are the same either way.
DECODE_PTX_SIGN = f"""{{
.reg .b32 d4pa, d4pb, d4k, d4z, d4c43, d4sm, d4m, d4mh, d4q, d4qh, d4c01, d4c23, d4s01, d4s23, d4t01, d4t23;
mov.b32 d4pa, {LUT_POS[0]:#010x};
mov.b32 d4pb, {LUT_POS[1]:#010x};
mov.b32 d4k, {BF16X2_M192:#010x};
mov.b32 d4z, 0;
mov.b32 d4c43, 0x43434343;
mov.b32 d4sm, 0x80008000;
and.b32 d4m, $4, 0x77777777;
shr.u32 d4mh, d4m, 16;
prmt.b32 d4q, d4pa, d4pb, d4m;
prmt.b32 d4qh, d4pa, d4pb, d4mh;
{_PLACE_AND_SCALE}prmt.b32 d4s01, $4, d4z, 0x1000;
prmt.b32 d4s23, $4, d4z, 0x3222;
shl.b32 d4t01, d4s01, 4;
shl.b32 d4t23, d4s23, 4;
lop3.b32 $0, $0, d4t01, d4sm, 0xF8;
lop3.b32 $1, $1, d4t23, d4sm, 0xF8;
lop3.b32 $2, $2, d4s01, d4sm, 0xF8;
lop3.b32 $3, $3, d4s23, d4sm, 0xF8;
}}"""
PTX_DECODES = {"asm": DECODE_PTX, "asm_sign": DECODE_PTX_SIGN}

# `DECODE_PTX_SIGN` with every constant an operand, for kernels that write their own loops (the Mosaic GPU kernel,
# `mgpu_mxfp4`): $5 = h (bf16x2, both lanes 2^(S−128): all 4 bytes of the word share one scale group), $6 = −192·h
# (`NEG192_PTX`, one multiply per group instead of two per word), $7 / $8 = the magnitude table `LUT_POS`, $9 =
# 0x43434343. The sign copies use the word itself as the permute's second pool (its other bytes are masked away by
# the 0x80008000 of the final lop3). Inline copies of `DECODE_PTX_SIGN` re-materialise 6 constants and two −192·h
# products per word in the PTX; ptxas had already shared most of them (the same speed on the H200).
DECODE_PTX_SIGN_OPERANDS = """{
.reg .b32 d4m, d4mh, d4q, d4qh, d4s01, d4s23, d4t01, d4t23;
and.b32 d4m, $4, 0x77777777;
shr.u32 d4mh, d4m, 16;
prmt.b32 d4q, $7, $8, d4m;
prmt.b32 d4qh, $7, $8, d4mh;
prmt.b32 $0, d4q, $9, 0x4240;
prmt.b32 $1, d4qh, $9, 0x4240;
prmt.b32 $2, d4q, $9, 0x4341;
prmt.b32 $3, d4qh, $9, 0x4341;
fma.rn.bf16x2 $0, $0, $5, $6;
fma.rn.bf16x2 $1, $1, $5, $6;
fma.rn.bf16x2 $2, $2, $5, $6;
fma.rn.bf16x2 $3, $3, $5, $6;
prmt.b32 d4s01, $4, $4, 0x1000;
prmt.b32 d4s23, $4, $4, 0x3222;
shl.b32 d4t01, d4s01, 4;
shl.b32 d4t23, d4s23, 4;
lop3.b32 $0, $0, 0x80008000, d4t01, 0xF8;
lop3.b32 $1, $1, 0x80008000, d4t23, 0xF8;
lop3.b32 $2, $2, 0x80008000, d4s01, 0xF8;
lop3.b32 $3, $3, 0x80008000, d4s23, 0xF8;
}"""
NEG192_PTX = """{
.reg .b32 k;
mov.b32 k, 0xC340C340;
mul.rn.bf16x2 $0, $1, k;
}"""  # $0 = −192·$1 (bf16x2): exact for h = 2^(S−128)


def scale_half_bf16(s_u8):
    """E8M0 codes -> bfloat16 h = 2^(S−128) (half the scale) from the exponent bits; S ≤ 1 gives 0."""
    e = jnp.maximum(s_u8.astype(jnp.int32), 1) - 1
    return jax.lax.bitcast_convert_type((e << 7).astype(jnp.uint16), jnp.bfloat16)


def decode_lo_hi_bf16_ref(p_u8, h_bf16):
    """`PTX_DECODES` in jnp, same bits: (lo, hi) = e2m1 · 2h in bfloat16 for packed bytes `[...]` uint8 and
    h = `scale_half_bf16` of their scales, broadcast to p_u8's shape."""
    lo, hi = decode_lo_hi_f32(p_u8)
    s2 = h_bf16.astype(jnp.float32) * 2.0
    return (lo * s2).astype(jnp.bfloat16), (hi * s2).astype(jnp.bfloat16)


# --------------------------------------------- e2m1 bits placed under bf16's exponent ("placed" weight layout)
# Why: the table decode above is ~20 instructions per 8 weights, and that (not HBM) bounds the Mosaic GPU kernel at
# decode-sized groups. A code (s e1 e0 m) whose magnitude bits sit at bf16 bits 8, 7, 6 (the two lowest exponent
# bits and the top mantissa bit) and whose sign sits at bit 15 reads exactly 2^−126 · v: for e1e0 ≥ 1 it is
# 2^(e1e0 − 127)·(1 + m/2), and for e1e0 = 0 the bf16 subnormal m · 2^−127. One bf16x2 multiply by 2^(S−1)
# then gives v · 2^(S−127) (exact: at most 2 significant bits). No table, no offset.
# The bits only have to be moved into place, and the weight is ours to lay out once (`place_codes`): the 32 bits of
# each word are permuted so that every output register is one shift of the word under a mask, or two (magnitudes
# from one shift, signs from another). Four disjoint translates of a lane's bit pattern {6, 7, 8, 15} cannot tile
# 32 bits (checked exhaustively), so two registers take their signs from a second shift: 5 shifts, 6 logic ops and
# 4 multiplies = 15 instructions per 8 weights. The shifts do not wrap, and four of the five go left: those are
# written as multiplies by 2^k, which ptxas issues as IMAD on the FMA pipe, next to the bf16 multiplies, instead of
# on the integer ALU pipe that the masks (and rotations) use — ncu put the first version of this decode (five
# rotations) on "math pipe throttle".
# Output registers as in the table decodes: $0..$3 = lo(b0, b1), lo(b2, b3), hi(b0, b1), hi(b2, b3) of the natural
# word (byte b, low / high nibble), lane 0 in the low half.
PLACED_SHIFTS = ((-6, 4), (0, 0), (3, 5), (6, 6))  # per output register: left shifts of (magnitudes, signs); < 0: right
_MAG_MASK, _SIGN_MASK = 0x01C001C0, 0x80008000  # bf16x2 bits 6..8 of each lane; bit 15 of each lane


def _placed_sources() -> np.ndarray:
    """src `[32]`: bit p of a placed word holds bit src[p] of the natural word (byte b, nibble n, code bit j at
    8b + 4n + j)."""
    src = np.full(32, -1, np.int64)
    for r, (t_mag, t_sign) in enumerate(PLACED_SHIFTS):
        nibble = r // 2
        for lane in (0, 1):
            code = 8 * (2 * (r % 2) + lane) + 4 * nibble  # the natural bit of the code's bit 0
            for j in range(3):
                src[6 + j + 16 * lane - t_mag] = code + j
            src[15 + 16 * lane - t_sign] = code + 3
    assert sorted(src) == list(range(32)), src  # a permutation: the shifts' sources tile the word, none wraps
    return src


PLACED_SOURCES = _placed_sources()


def _ptx_placed() -> str:
    shifts = sorted({t for pair in PLACED_SHIFTS for t in pair} - {0})
    split = [r for r, (t_mag, t_sign) in enumerate(PLACED_SHIFTS) if t_mag != t_sign]

    def src(t):
        return "$4" if t == 0 else f"d4l{t}" if t > 0 else f"d4r{-t}"

    lines = [".reg .b32 " + ", ".join([src(t) for t in shifts] + [f"d4s{r}" for r in split]) + ";"]
    lines += [f"mul.lo.u32 {src(t)}, $4, {1 << t};" if t > 0 else f"shr.u32 {src(t)}, $4, {-t};" for t in shifts]
    for r, (t_mag, t_sign) in enumerate(PLACED_SHIFTS):
        if t_mag == t_sign:
            lines.append(f"and.b32 ${r}, {src(t_mag)}, {_MAG_MASK | _SIGN_MASK:#010x};")
        else:  # (magnitudes & mask) | clean signs: lop3 0xEA = (a & b) | c
            lines.append(f"and.b32 d4s{r}, {src(t_sign)}, {_SIGN_MASK:#010x};")
            lines.append(f"lop3.b32 ${r}, {src(t_mag)}, {_MAG_MASK:#010x}, d4s{r}, 0xEA;")
    lines += [f"mul.rn.bf16x2 ${r}, ${r}, $5;" for r in range(4)]
    return "{\n" + "\n".join(lines) + "\n}"


DECODE_PTX_PLACED = _ptx_placed()  # $4 = a placed word, $5 = bf16x2 (h, h) with h = 2^(S−1) (`scale_placed_bf16`)


def _permute_word_bits(packed, sources):
    """Packed bytes `[..., 4n]` uint8 -> same shape: in each little-endian 32-bit word, bit p of the result is bit
    sources[p] of the input (one shift-and-mask per distinct bit move, elementwise)."""
    if packed.shape[-1] % 4:
        raise ValueError(f"the placed code layout needs whole 32-bit words: packed width {packed.shape[-1]} is "
                         "not a multiple of 4")
    b = packed.reshape(*packed.shape[:-1], -1, 4).astype(jnp.uint32)
    word = b[..., 0] | b[..., 1] << 8 | b[..., 2] << 16 | b[..., 3] << 24
    moves: dict[int, int] = {}
    for p, n in enumerate(sources):
        moves[p - int(n)] = moves.get(p - int(n), 0) | 1 << int(n)
    out = jnp.zeros_like(word)
    for delta, mask in sorted(moves.items()):
        part = word & jnp.uint32(mask)
        out = out | (part << delta if delta >= 0 else part >> -delta)
    out_b = jnp.stack([(out >> 8 * i) & 0xFF for i in range(4)], axis=-1).astype(jnp.uint8)
    return out_b.reshape(packed.shape)


def place_codes(packed):
    """Packed codes `[..., K/2]` uint8 (natural) -> the placed layout, same shape: each little-endian 32-bit word's
    bits permuted by `PLACED_SOURCES`. Once per weight."""
    return _permute_word_bits(packed, PLACED_SOURCES)


def unplace_codes(placed):
    """The inverse of `place_codes`: placed codes -> the natural (checkpoint) layout, bit for bit."""
    return _permute_word_bits(placed, np.argsort(PLACED_SOURCES))


def scale_placed_bf16(s_u8):
    """E8M0 codes S ∈ [0, 128] -> bfloat16 2^(S−1), the placed decode's multiplier; S = 0 gives 0 (a zero scale, as
    `scale_f32`). Codes above 128 overflow bf16 here: `mgpu_mxfp4.prepare_weight` lowers them per expert first."""
    s = s_u8.astype(jnp.int32)
    return jax.lax.bitcast_convert_type(jnp.where(s == 0, 0, (s + 126) << 7).astype(jnp.uint16), jnp.bfloat16)


# ------------------------------------- e2m1 -> e4m3 for the fp8 tensor cores (`experimental.mxfp4_fp8_mma`)
# Why: at decode-sized groups the bf16 decode above (21 instructions per 8 elements, plus the register shuffles
# that build bf16 mma fragments from it) is what bounds the MXFP4 kernel, not HBM. Every e2m1 value times 2^−6 is an
# e4m3 value with the same bit layout shifted: the code's three magnitude bits (e1 e0 m) placed as e4m3's lowest two
# exponent bits and top mantissa bit read 2^(E−7)·(1 + m/2) for E = e1e0 ≥ 1 and m·2^−7 (an e4m3 subnormal) for
# E = 0 — exactly 2^−6 times the e2m1 value 2^(E−1)·(1 + m/2), resp. m/2. So the codes go to Hopper's fp8 tensor
# cores after two shifts and masks per register, the E8M0 scale (times 2^6) applied to each 32-element group's
# partial dot instead of to every weight (one fp8 wgmma instruction contracts exactly 32 elements), x as two e4m3
# planes (`split_e4m3_planes`). 7 instructions per 8 elements, no table constants; a register of 4 decoded codes is
# exactly what an fp8 wgmma fragment holds.
#   lo (even elements, low nibbles): magnitude bits 0..2 of each byte to bits 2..4 (<< 2), the sign bit 3 to 7 (<< 4);
#   hi (odd elements, high nibbles): magnitude bits 4..6 to bits 2..4 (>> 2), the sign already at bit 7.
E4M3_DECODE_EXP = 6  # the decoded codes are 2^−6 times the e2m1 values; the scales carry 2^6

DECODE_E4M3_PTX = """{
.reg .b32 e4a, e4b, e4c, e4d;
shl.b32 e4a, $2, 2;
shl.b32 e4b, $2, 4;
and.b32 e4b, e4b, 0x80808080;
lop3.b32 $0, e4a, 0x1C1C1C1C, e4b, 0xEA;
shr.u32 e4c, $2, 2;
and.b32 e4d, $2, 0x80808080;
lop3.b32 $1, e4c, 0x1C1C1C1C, e4d, 0xEA;
}"""


# A byte-permute table decode to normal e4m3 codes (0.5 = 0x30, unscaled; 9 instructions per 8 elements and two
# table words) was timed beside this one on the H200: the same error, 3-5% slower; the tensor cores take
# the subnormal codes exactly.


def decode_lo_hi_e4m3_ref(p_u8):
    """Packed bytes `[...]` uint8 -> (lo, hi) float8_e4m3fn: 2^−6 times the e2m1 values of the low / high nibbles
    (exact; the smallest nonzero is an e4m3 subnormal; code 8 gives −0). The jnp twin of `DECODE_E4M3_PTX`."""
    lut = jnp.asarray(E2M1_VALUES * 2.0 ** -E4M3_DECODE_EXP).astype(jnp.float8_e4m3fn)
    return lut[(p_u8 & 0x0F).astype(jnp.int32)], lut[(p_u8 >> 4).astype(jnp.int32)]


def split_e4m3_planes(x):
    """`x [M, K]` -> (x_hi, x_lo) float8_e4m3fn `[M, K]` and `inv [M]` float32 with x ≈ (x_hi + x_lo) · inv.

    Each row is scaled by a power of two c (so |x·c| < 128), x_hi = e4m3(x·c), x_lo = e4m3(x·c − x_hi); inv = 1/c
    (exact). hi + lo carry about 8 significant bits, like bf16: the relative error per element is ≤ 2^−8 (plus an
    absolute ≤ 2^−10 / c where the residual is an e4m3 subnormal). A zero row gets c = 1.

    x_hi is rounded with `reduce_precision` (4 exponent, 3 mantissa bits: e4m3's rounding below 240, except that it
    flushes values under 2^−6 to zero — those go whole into x_lo), not by converting to e4m3 and back: inside a jit,
    XLA on the GPU folded that pair of converts away and the residual came out as zeros (H200)."""
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1)
    _, e = jnp.frexp(jnp.where(amax > 0, amax, 1.0))  # amax < 2^e
    c = jnp.ldexp(jnp.float32(1.0), 7 - e)  # amax · c < 2^7
    xs = xf * c[:, None]
    hi = jax.lax.reduce_precision(xs, exponent_bits=4, mantissa_bits=3)
    return hi.astype(jnp.float8_e4m3fn), (xs - hi).astype(jnp.float8_e4m3fn), (1.0 / c).astype(jnp.float32)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def random_weight(key, num_experts: int, in_features: int, out_features: int, scale_exp=(118, 126)) -> MXFP4Weight:
    """Random codes and E8M0 scales in `scale_exp` (weights of magnitude ~2^-9..2^-1): benches and tests."""
    kp, ks = jax.random.split(key)
    packed = jax.random.randint(kp, (num_experts, out_features, in_features // 2), 0, 256, jnp.int32)
    scale = jax.random.randint(ks, (num_experts, out_features, in_features // GROUP), scale_exp[0],
                               scale_exp[1] + 1, jnp.int32)
    return MXFP4Weight(packed.astype(jnp.uint8), scale.astype(jnp.uint8))
