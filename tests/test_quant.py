"""The codec (pallas_kernels.codec) and the cache formats on it (kimi_jax.quant): hand-worked bit patterns,
rounding, scales, byte sizes, error bounds."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kimi_jax import quant as Q
from pallas_kernels import codec as C
from kimi_jax.cache import index_key_bytes_per_token, latent_bytes_per_token


def bits(a):
    return np.asarray(jnp.asarray(a)).view(np.uint8)


# ------------------------------------------------------------------------------------------------ e4m3

E4M3_GOLDEN = [  # value -> byte (sign | 4-bit exponent, bias 7 | 3-bit mantissa)
    (1.0, 0x38), (0.5, 0x30), (1.125, 0x39), (1.25, 0x3A), (256.0, 0x78), (448.0, 0x7E), (-448.0, 0xFE),
    (2.0 ** -6, 0x08), (2.0 ** -9, 0x01), (0.0, 0x00), (-0.0, 0x80),
    (1.0625, 0x38),                   # tie between 1.0 (mantissa 000) and 1.125 (001): even wins
    (1.1875, 0x3A),                   # tie between 1.125 (001) and 1.25 (010): even wins
    (1.0625 + 2.0 ** -12, 0x39),      # just above the tie: no double rounding through f16
    (2.0 ** -10, 0x00), (3 * 2.0 ** -10, 0x02),  # subnormal ties
    (464.0, 0x7E), (1e6, 0x7E), (-1e6, 0xFE),     # saturation (a plain cast gives NaN)
]


def test_e4m3_golden_bit_patterns():
    x = np.array([v for v, _ in E4M3_GOLDEN], np.float32)
    want = np.array([b for _, b in E4M3_GOLDEN], np.uint8)
    np.testing.assert_array_equal(bits(C.to_e4m3(x)), want)
    np.testing.assert_array_equal(bits(jax.jit(C.to_e4m3)(x)), want)
    assert np.isnan(np.asarray(C.to_e4m3(np.float32(np.nan)).astype(jnp.float32)))


def test_e4m3_matches_ml_dtypes_on_random_data():
    x = (np.random.default_rng(0).standard_normal(4096) * np.exp2(np.random.default_rng(1).integers(-12, 9, 4096)))
    x = np.clip(x.astype(np.float32), -448, 448)
    np.testing.assert_array_equal(bits(C.to_e4m3(x)), x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))


# ------------------------------------------------------------------------------------------------ e2m1

E2M1_GOLDEN = [  # value -> 4-bit code (sign | 2-bit exponent | 1-bit mantissa) on {0,.5,1,1.5,2,3,4,6}
    (0.0, 0x0), (0.5, 0x1), (1.0, 0x2), (1.5, 0x3), (2.0, 0x4), (3.0, 0x5), (4.0, 0x6), (6.0, 0x7),
    (0.25, 0x0), (0.2501, 0x1), (0.75, 0x2), (0.7499, 0x1), (1.25, 0x2), (1.2501, 0x3), (1.75, 0x4),
    (2.5, 0x4), (2.5001, 0x5), (3.5, 0x6), (5.0, 0x6), (5.0001, 0x7),       # ties go to the even code
    (6.5, 0x7), (100.0, 0x7), (-100.0, 0xF),                                 # saturation
    (-0.0, 0x8), (-0.2, 0x8), (-0.75, 0xA), (-1.5, 0xB), (-3.5, 0xE),        # sign kept, −0 is 0x8
]


def test_e2m1_golden_codes_and_values():
    x = np.array([v for v, _ in E2M1_GOLDEN], np.float32)
    want = np.array([c for _, c in E2M1_GOLDEN], np.uint8)
    codes = np.asarray(C.e2m1_encode(x))
    np.testing.assert_array_equal(codes, want)
    vals = np.asarray(C.e2m1_decode(codes))
    np.testing.assert_array_equal(vals, C.E2M1_VALUES[want])
    assert np.signbit(vals[24]) and np.signbit(vals[23])  # −0.2 and −0.0 decode to −0


def test_e2m1_matches_ml_dtypes_on_random_data():
    x = (np.random.default_rng(2).standard_normal(4096) * 3).astype(np.float32)
    x[:64] = np.repeat(np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0], np.float32), 8)
    got = np.asarray(C.e2m1_decode(C.e2m1_encode(x)))
    ref = x.astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(got, ref)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(ref))


def test_nibble_order_low_nibble_is_even_element():
    codes = np.array([[0x1, 0x2, 0x3, 0x4, 0xF, 0x8]], np.uint8)
    packed = np.asarray(C.pack_nibbles(codes))
    np.testing.assert_array_equal(packed, [[0x21, 0x43, 0x8F]])
    np.testing.assert_array_equal(np.asarray(C.unpack_nibbles(packed)), codes)


def test_pow2_ceil_is_exact():
    x = np.array([1.0, 1.0000001, 0.5, 0.3, 3.0, 448.0 / 448, 449.0 / 448, 2.0 ** -22], np.float32)
    np.testing.assert_array_equal(np.asarray(C.pow2_ceil(x)), [1, 2, 0.5, 0.5, 4, 1, 2, 2.0 ** -22])


# ------------------------------------------------------------------------------------------------ MXFP4 keys

def test_mxfp4_golden_group():
    x = np.zeros((1, 128), np.float32)
    x[0, :8] = 4 * np.array([6, 3, -1.5, 0.5, 0.25, 0.75, -0.0, 5])  # amax 24 -> 2^ceil(log2 4) = 4, byte 129
    x[0, 32:36] = [7, -3.5, 1.5, 0.2]  # amax 7 -> 7/6 -> 2^1, byte 128: 3.5 (tie) -> 4, -1.75 (tie) -> -2
    # group 2 all zero -> byte 0; group 3: amax 6 exactly -> scale 1 (byte 127)
    x[0, 96:98] = [6.0, -2.9]
    packed, scale = C.mxfp4_quantize(x)
    np.testing.assert_array_equal(np.asarray(scale), [[129, 128, 0, 127]])
    p = np.asarray(packed)[0]
    np.testing.assert_array_equal(p[:4], [0x57, 0x1B, 0x20, 0x68])
    np.testing.assert_array_equal(p[4:16], 0)
    np.testing.assert_array_equal(p[16:18], [0xC6, 0x02])
    np.testing.assert_array_equal(p[48], 0xD7)  # 6 -> 0x7 (low), -2.9 -> -3 = 0xD (high)
    deq = np.asarray(C.mxfp4_dequantize(packed, scale))[0]
    np.testing.assert_array_equal(deq[:8], 4 * np.array([6, 3, -1.5, 0.5, 0, 1, -0.0, 4], np.float32))
    np.testing.assert_array_equal(deq[32:36], [8, -4, 2, 0])
    np.testing.assert_array_equal(deq[64:96], 0)


def test_mxfp4_host_forms_equal_the_jnp_ones():
    """convert's NumPy MXFP4 (checkpoints) and the jnp one (caches, kernels' reference) are one format: same bits
    both ways, golden ties and group edges included."""
    mag = np.float32([[0.01], [1], [30], [1], [5], [0.2]])
    x = np.random.default_rng(3).standard_normal((6, 128)).astype(np.float32) * mag
    x[0, :8] = 0.01 * np.array([6, 3, -1.5, 0.5, 0.25, 0.75, -0.0, 5])  # ties and a −0
    x[5, 32:64] = 0.0  # an all-zero group
    packed, scale = C.mxfp4_quantize(x)
    packed_np, scale_np = C.mxfp4_quantize_np(x)
    np.testing.assert_array_equal(packed_np, np.asarray(packed))
    np.testing.assert_array_equal(scale_np, np.asarray(scale))
    np.testing.assert_array_equal(C.mxfp4_dequantize_np(packed_np, scale_np),
                                  np.asarray(C.mxfp4_dequantize(packed, scale)))


# ------------------------------------------------------------------------------------------------ FP8 keys

def test_index_fp8_golden_scales_and_codes():
    x = np.zeros((3, 256), np.float32)
    x[0, :3] = [1.0, -0.5, 0.3]  # amax 1 -> 1/448 rounded up = 2^-8: 256, -128, 76.8 -> 80
    x[0, 128] = 448.0  # amax 448 -> scale exactly 1
    x[1, 0] = 449.0  # -> scale 2
    # row 2: zeros -> max(0, 1e-4) / 448 = 2.23e-7 -> 2^-22
    codes, sc = C.index_fp8_quantize(x)
    np.testing.assert_array_equal(np.asarray(sc), [[2.0 ** -8, 1.0], [2.0, 2.0 ** -22], [2.0 ** -22, 2.0 ** -22]])
    b = bits(codes)
    np.testing.assert_array_equal(b[0, :3], [0x78, 0xF0, 0x6A])
    assert b[0, 128] == 0x7E and b[1, 0] == 0x76  # 449 / 2 = 224.5 -> 224 = 1.75·2^7: 0|1110|110
    deq = np.asarray(C.index_fp8_dequantize(codes, sc))
    np.testing.assert_array_equal(deq[0, :3], [1.0, -0.5, 0.3125])
    assert deq[1, 0] == 448.0 and not deq[2].any()


def test_index_fp8_partial_group_dim():
    fmt = Q.IndexKeyFormat("fp8", 16)  # the tiny preset: one scale for a partial group of 16
    x = np.random.default_rng(4).standard_normal((5, 16)).astype(np.float32)
    codes, sc = fmt.quantize(x)
    assert codes.shape == (5, 16) and sc.shape == (5, 1)
    np.testing.assert_allclose(np.asarray(fmt.dequantize((codes, sc))), x, rtol=2 ** -4, atol=1e-6)


def test_fake_quant_index_fp8_and_hadamard():
    rng = np.random.default_rng(5)
    q = rng.standard_normal((4, 128)).astype(np.float32)
    k = rng.standard_normal((4, 128)).astype(np.float32)
    fq = np.asarray(Q.fake_quant_index_fp8(q))
    np.testing.assert_array_equal(fq, np.asarray(Q.round_trip(Q.IndexKeyFormat("fp8", 128), q)))
    hq, hk = np.asarray(Q.hadamard(q)), np.asarray(Q.hadamard(k))
    np.testing.assert_allclose(hq @ hk.T, q @ k.T, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(Q.hadamard(Q.hadamard(q))), q, atol=1e-5)  # symmetric and orthonormal
    with pytest.raises(ValueError, match="power-of-two"):
        Q.hadamard(np.zeros(96))


# ------------------------------------------------------------------------------------------------ NVFP4 latent

def test_nvfp4_golden_blocks():
    base = np.zeros(16, np.float32)
    base[:8] = [6, -3, 0.75, 1.25, 0.25, -0.0, 5, 2.5]
    blocks = np.zeros((5, 16), np.float32)
    blocks[0] = base  # amax 6 -> scale 1.0 = 0x38
    blocks[1] = 2 * base  # amax 12 -> scale 2.0 = 0x40
    blocks[2] = base
    blocks[2, 0] = 6.375  # amax/6 = 1.0625: e4m3 tie -> 1.0, then 6.375 saturates to 6
    # blocks[3]: zeros -> scale 0
    blocks[4, 0] = 1e-5  # scale 1.7e-6 underflows e4m3 -> stored as zeros
    packed, s16 = C.nvfp4_quantize(blocks.reshape(1, 80))
    np.testing.assert_array_equal(bits(s16)[0], [0x38, 0x40, 0x38, 0x00, 0x00])
    p = np.asarray(packed).reshape(5, 8)
    want = [0xD7, 0x22, 0x80, 0x46, 0, 0, 0, 0]
    np.testing.assert_array_equal(p[0], want)
    np.testing.assert_array_equal(p[1], want)
    np.testing.assert_array_equal(p[2], want)
    np.testing.assert_array_equal(p[3:], 0)
    deq = np.asarray(C.nvfp4_dequantize(packed, s16)).reshape(5, 16)
    rounded = np.array([6, -3, 1, 1, 0, -0.0, 4, 2], np.float32)
    np.testing.assert_array_equal(deq[0, :8], rounded)
    np.testing.assert_array_equal(deq[1, :8], 2 * rounded)
    np.testing.assert_array_equal(deq[2, :8], rounded)
    assert not deq[3:].any()


def test_latent_formats_with_layer_scale():
    x = np.zeros((1, 40), np.float32)  # R = 32, rope = 8
    x[0, 0], x[0, 32], x[0, 33] = 12.0, 3.0, 1000.0
    fp8 = Q.LatentFormat("fp8", 32, 8)
    (codes,) = fp8.quantize(x, 2.0)
    assert bits(codes)[0, 0] == 0x4C and bits(codes)[0, 32] == 0x3C  # 6 = 1.5·2^2: 0|1001|100; 1.5: 0|0111|100
    assert bits(codes)[0, 33] == 0x7E  # 500 saturates to 448
    out = np.asarray(fp8.dequantize((codes,), 2.0))
    assert out[0, 0] == 12.0 and out[0, 32] == 3.0 and out[0, 33] == 896.0
    nv = Q.LatentFormat("nvfp4", 32, 8)
    packed, s16, rope = nv.quantize(x, 2.0)
    assert bits(s16)[0, 0] == 0x38  # 12 / 2 = 6 -> block scale 1
    assert bits(rope)[0, 0] == 0x3C
    np.testing.assert_array_equal(np.asarray(nv.dequantize((packed, s16, rope), 2.0))[0, [0, 32, 33]], [12, 3, 896])


# ------------------------------------------------------------------------------------------------ sizes

FULL = [Q.LatentFormat("bf16", 512, 64), Q.LatentFormat("fp8", 512, 64), Q.LatentFormat("nvfp4", 512, 64),
        Q.IndexKeyFormat("bf16", 128), Q.IndexKeyFormat("fp8", 128), Q.IndexKeyFormat("mxfp4", 128)]


@pytest.mark.parametrize("fmt", FULL + [Q.LatentFormat("nvfp4", 32, 8), Q.IndexKeyFormat("fp8", 16)], ids=str)
def test_packed_bytes_per_token_equal_cache_figures(fmt):
    if isinstance(fmt, Q.LatentFormat):
        want = latent_bytes_per_token(fmt.latent, fmt.rope, fmt.kv_dtype)
    else:
        want = index_key_bytes_per_token(fmt.dim, fmt.index_dtype)
    x = np.random.default_rng(6).standard_normal((7, fmt.width)).astype(np.float32)
    parts = fmt.quantize(x)
    assert sum(np.asarray(p).nbytes for p in parts) == 7 * want
    assert [p.shape[-1] for p in parts] == [p.width for p in fmt.parts]
    assert [np.dtype(p.dtype) for p in parts] == [p.dtype for p in fmt.parts]
    Q.check_against_cache(fmt)


def test_spec_byte_figures():
    assert [f.bytes_per_token for f in FULL] == [1152, 576, 352, 256, 132, 68]


def test_bad_widths_are_clear_errors():
    with pytest.raises(ValueError, match="multiple of 32"):
        Q.IndexKeyFormat("mxfp4", 16)
    with pytest.raises(ValueError, match="unknown kv dtype"):
        Q.LatentFormat("int4", 512, 64)
    with pytest.raises(ValueError, match=r"\[..., 576\]"):
        Q.LatentFormat("fp8", 512, 64).quantize(np.zeros((2, 512)))


# ------------------------------------------------------------------------------------------------ error bounds

def _data(shape, seed):
    rng = np.random.default_rng(seed)
    mag = np.exp2(rng.uniform(-3, 3, shape[:-1] + (1,)))  # per-row magnitude spread
    return (rng.standard_normal(shape) * mag).astype(np.float32)


def rel_rms(a, b):
    return float(np.sqrt(np.mean((np.asarray(a) - b) ** 2) / np.mean(np.square(b))))


def test_round_trip_error_bounds_fp8_latent():
    x = _data((64, 576), 7)
    fmt = Q.LatentFormat("fp8", 512, 64)
    y = np.asarray(Q.round_trip(fmt, x))
    assert np.all(np.abs(y - x) <= 2.0 ** -4 * np.abs(x) + 2.0 ** -10)  # half an ulp; subnormal step 2^-9
    assert rel_rms(y, x) < 0.035


def test_round_trip_error_bounds_nvfp4_latent():
    x = _data((64, 576), 8)
    fmt = Q.LatentFormat("nvfp4", 512, 64)
    packed, s16, rope = fmt.quantize(x)
    y = np.asarray(fmt.dequantize((packed, s16, rope)))
    s = np.repeat(np.asarray(s16.astype(jnp.float32)), 16, axis=-1)
    assert np.all(np.abs(y[:, :512] - x[:, :512]) <= s)  # ≤ half the widest e2m1 gap (2) × block scale
    assert np.all(np.abs(y[:, 512:] - x[:, 512:]) <= 2.0 ** -4 * np.abs(x[:, 512:]) + 2.0 ** -10)
    assert rel_rms(y[:, :512], x[:, :512]) < 0.11


def test_round_trip_error_bounds_index_keys():
    x = _data((64, 128), 9)
    codes, sc = C.index_fp8_quantize(x)
    y = np.asarray(C.index_fp8_dequantize(codes, sc))
    assert np.all(np.abs(x) / np.asarray(sc) <= 448)
    assert np.all(np.abs(y - x) <= 2.0 ** -4 * np.abs(x) + np.asarray(sc) * 2.0 ** -10)
    assert rel_rms(y, x) < 0.035
    packed, e8 = C.mxfp4_quantize(x)
    y = np.asarray(C.mxfp4_dequantize(packed, e8))
    scale = np.repeat(np.exp2(np.asarray(e8, np.float32) - 127), 32, axis=-1)
    assert np.all(np.abs(y - x) <= scale)  # no saturation: ≤ half the widest gap × scale
    assert np.all(np.max(np.abs(x.reshape(64, 4, 32)), -1) <= 6 * scale[:, ::32])
    assert rel_rms(y, x) < 0.13


def test_quantise_inside_an_outer_jit_with_a_traced_layer_scale():
    x = _data((2, 576), 10)
    fmt = Q.LatentFormat("nvfp4", 512, 64)
    jitted = jax.jit(lambda a, s: fmt.dequantize(fmt.quantize(a, s), s))(x, jnp.float32(0.5))
    np.testing.assert_array_equal(np.asarray(jitted), np.asarray(Q.round_trip(fmt, x, 0.5)))
