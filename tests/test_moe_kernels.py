"""MoE kernels (`pallas_kernels.moe`): tile schedules, MXFP4 decoding (the PTX decodes modelled instruction by
instruction), the TPU grouped matmul (Mosaic, run in TPU interpret mode) against `jax.lax.ragged_dot`, the fused
expert FFN against `reference.expert_ffn`, bit-for-bit determinism, lowering for real TPU targets, the GPU grouped
matmul (native Triton, run in Triton's interpreter) where a test needs it beside the others (its own checks:
tests/test_triton_moe.py), the Mosaic GPU MXFP4 kernel, and expert parallelism on 8 fake CPU devices (in a
subprocess, so the device-count flag does not leak)."""

import dataclasses
import functools
import os
import re
import subprocess
import sys
import textwrap
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe import gpu_triton, mxfp4 as mx, ops, reference, schedule, tpu
from pallas_kernels.moe.gpu_triton import GpuConfig
from server_process import cpu_devices_env

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)

SIZES = [50, 0, 70, 13, 40]  # an empty expert, and 27 rows of no expert (M = 200 > 173)
M_ROWS = 200


def situ(g, u):  # SPEC §7
    return 4.0 * jnp.tanh(g / 4.0) * jax.nn.sigmoid(g) * (25.0 * jnp.tanh(u / 25.0))


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.abs(a - b).max() / np.abs(b).max())


def _starts_ends(sizes, m):
    ends = np.cumsum(sizes)
    starts = ends - sizes
    return np.append(starts, ends[-1]), np.append(ends, m)  # pseudo-group E: the uncovered tail


@pytest.mark.parametrize("bm", [16, 32])
@pytest.mark.parametrize("sizes", [SIZES, [0, 0, 200, 0, 0], [1, 1, 1, 1, 196]])
def test_group_tiles_cover_each_row_once_within_its_group(bm, sizes):
    E = len(sizes)
    tiles = schedule.group_tiles(jnp.asarray(sizes), M_ROWS, bm)
    group, row0, row_end, num = (np.asarray(a) for a in tiles)
    starts, ends = _starts_ends(np.asarray(sizes), M_ROWS)
    num = int(num[0])
    assert num == sum(-(-s // bm) for s in sizes) + -(-(M_ROWS - sum(sizes)) // bm)
    assert group.shape[0] == schedule.num_group_tiles_bound(M_ROWS, E, bm) >= num
    seen = np.zeros(M_ROWS, int)
    for t in range(num):
        g, r0, r1 = group[t], row0[t], min(row0[t] + bm, row_end[t])
        assert starts[g] <= r0 < r1 <= ends[g] == row_end[t]
        seen[r0:r1] += 1
    assert (seen == 1).all()


def _most_tiles(m, groups, bm):
    """The most tiles any routing of m rows over `groups` groups needs: n non-empty groups take at most
    n + floor((m − n) / bm) (one row each, the rest in one group), the most over n ≤ min(m, groups)."""
    return max([n + (m - n) // bm for n in range(1, min(m, groups) + 1)], default=0)


@pytest.mark.parametrize("bm", [1, 4, 16])
@pytest.mark.parametrize("E", [1, 3, 8, 256])
def test_tile_bounds_cover_every_routing_and_scale_with_rows_not_experts(bm, E):
    """The tile arrays and grids are sized by the rows: ceil(M/bm) + min(M, E) − 1 tiles hold any routing of M rows,
    so one token routed to 8 of 256 experts plans 8 tiles of 16 rows, not 257."""
    for m in range(0, 41):
        assert schedule.tiles_bound(m, E, bm) >= _most_tiles(m, E, bm)  # rows sorted by expert, no tail group
        assert schedule.num_group_tiles_bound(m, E, bm) >= _most_tiles(m, E + 1, bm)  # + the uncovered tail
        assert schedule.num_straddle_tiles_bound(-(-m // bm) * bm, E, bm) >= 1
    # the worst routing for group_tiles: m − 1 groups of one row, then the uncovered tail
    m, bm_ = 12, 4
    sizes = jnp.asarray([1] * min(E, m - 1) + [0] * (E - min(E, m - 1)))
    tiles = schedule.group_tiles(sizes, m, bm_)
    assert int(tiles.num_tiles[0]) <= tiles.group.shape[0] == schedule.num_group_tiles_bound(m, E, bm_)
    assert schedule.tiles_bound(8, 256, 16) == 8 and schedule.num_group_tiles_bound(8, 256, 16) == 8


@pytest.mark.parametrize("sizes", [SIZES, [0, 0, 200, 0, 0], [1, 1, 1, 1, 196]])
def test_straddle_tiles_visit_blocks_in_order_and_cover_rows_once(sizes):
    bm, m = 32, 224  # rows padded to a multiple of bm
    tiles = schedule.straddle_tiles(jnp.asarray(sizes), m, bm)
    group, blk, first, gs, ge, num = (np.asarray(a) for a in tiles)
    num = int(num[0])
    seen = np.zeros(m, int)
    for t in range(num):
        rows = np.arange(blk[t] * bm, (blk[t] + 1) * bm)
        seen[rows[(rows >= gs[group[t]]) & (rows < ge[group[t]])]] += 1
        assert first[t] == (t == 0 or blk[t] != blk[t - 1])
    assert (seen == 1).all()
    assert (blk[num:] == blk[num - 1]).all() and not first[num:].any()  # idle steps: no new DMA
    assert (np.diff(blk[:num]) >= 0).all()


def test_mxfp4_decoders_are_exact():
    b = jnp.arange(256, dtype=jnp.uint8)
    want_lo, want_hi = mx.E2M1_VALUES[np.arange(256) & 15], mx.E2M1_VALUES[np.arange(256) >> 4]
    lo, hi = mx.decode_lo_hi_f16(b)
    np.testing.assert_array_equal(np.asarray(lo) * 2.0 ** mx.F16_TRICK_EXP, want_lo)
    np.testing.assert_array_equal(np.asarray(hi) * 2.0 ** mx.F16_TRICK_EXP, want_hi)
    lo, hi = mx.decode_lo_hi_f32(b)
    np.testing.assert_array_equal(np.asarray(lo), want_lo)
    np.testing.assert_array_equal(np.asarray(hi), want_hi)
    s = np.arange(1, 255, dtype=np.uint8)
    np.testing.assert_array_equal(np.asarray(mx.scale_f32(jnp.asarray(s))), np.ldexp(1.0, s.astype(int) - 127))


@pytest.mark.filterwarnings("ignore:overflow encountered in ldexp")  # the host decode on the NaN scale (255)
def test_dequantize_matches_the_checkpoint_decoder():
    from pallas_kernels.codec import mxfp4_dequantize_np as mxfp4_dequant

    rng = np.random.default_rng(0)
    packed = rng.integers(0, 256, (3, 8, 32), dtype=np.uint8)
    scale = rng.integers(100, 140, (3, 8, 2), dtype=np.uint8)
    scale[0, 0, 0] = 255  # NaN scale
    want = np.swapaxes(mxfp4_dequant(packed, scale), -1, -2)  # [E, K, N]
    got = np.asarray(mx.dequantize(mx.MXFP4Weight(jnp.asarray(packed), jnp.asarray(scale))))
    np.testing.assert_array_equal(got, want)  # NaNs in the same places compare equal here


def test_weight_forms_and_errors():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((16, 64)), jnp.float32)
    w = mx.random_weight(jax.random.key(0), 2, 64, 32)
    gs = jnp.asarray([9, 7], jnp.int32)
    gmm = jax.jit(functools.partial(ops.grouped_matmul, backend="reference"))
    a = gmm(x, w, gs)
    b = gmm(x, w.packed, gs, w_scale=w.scale)
    c = gmm(x, (w.packed, w.scale), gs)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, c)
    np.testing.assert_allclose(a, reference.grouped_matmul(x, mx.dequantize(w), gs), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="w_scale"):
        ops.grouped_matmul(x, w.packed, gs, backend="reference")
    with pytest.raises(ValueError, match="do not fit"):
        ops.grouped_matmul(x, w.packed, gs, w_scale=w.scale[..., :1], backend="reference")
    with pytest.raises(ValueError, match="K=64"):
        ops.grouped_matmul(x[:, :32], w, gs, backend="reference")
    with pytest.raises(ValueError, match="group_sizes"):
        ops.grouped_matmul(x, w, gs[:1], backend="reference")
    with pytest.raises(ValueError, match="unknown MoE backend"):
        ops.grouped_matmul(x, w, gs, backend="cuda")
    with pytest.raises(ValueError, match="unknown activation"):
        ops.resolve_activation("gelu")
    assert ops.resolve_backend("auto") == "reference"  # CPU
    assert ops.resolve_backend("mgpu", quantized=True) == "gpu"


def _run_ptx(ptx: str, regs: dict) -> dict:
    """A NumPy model of the few PTX instructions the `mx.PTX_DECODES` use (mov, and, shr, shl, prmt in its default
    mode, lop3, fma.rn.bf16x2), run over their text: checks the tables, selectors and operand numbering without a
    GPU."""
    import ml_dtypes

    def val(t):
        return regs[t] if t in regs else int(t, 0)

    def bf(u16):
        return float(np.array([u16], np.uint16).view(ml_dtypes.bfloat16)[0])

    for line in ptx.strip().strip("{}").split(";"):
        line = line.strip()
        if not line or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        a = [x.strip() for x in args.split(",")]
        if op == "mov.b32":
            r = val(a[1])
        elif op == "and.b32":
            r = val(a[1]) & val(a[2])
        elif op == "shr.u32":
            r = val(a[1]) >> val(a[2])
        elif op == "shl.b32":
            r = val(a[1]) << val(a[2])
        elif op == "mul.lo.u32":
            r = val(a[1]) * val(a[2])
        elif op == "prmt.b32":  # output byte i = pool[sel_i & 7], or its sign replicated when sel_i & 8
            pool = [(val(a[1]) >> 8 * i) & 255 for i in range(4)] + [(val(a[2]) >> 8 * i) & 255 for i in range(4)]
            r = 0
            for i in range(4):
                sel = (val(a[3]) >> 4 * i) & 15
                b = pool[sel & 7]
                r |= ((255 if b & 128 else 0) if sel & 8 else b) << 8 * i
        elif op == "lop3.b32":
            x, y, z, lut = (val(t) for t in a[1:])
            r = sum(((lut >> ((((x >> i) & 1) << 2) | (((y >> i) & 1) << 1) | ((z >> i) & 1))) & 1) << i
                    for i in range(32))
        elif op in ("fma.rn.bf16x2", "mul.rn.bf16x2"):
            x, y, z = (val(t) for t in a[1:]) if op.startswith("fma") else (val(a[1]), val(a[2]), 0)
            r = 0
            for h in range(2):
                f = bf((x >> 16 * h) & 0xFFFF) * bf((y >> 16 * h) & 0xFFFF) + bf((z >> 16 * h) & 0xFFFF)
                r |= int(np.array([f], ml_dtypes.bfloat16).view(np.uint16)[0]) << 16 * h
        else:
            raise AssertionError(f"instruction {op} not modelled")
        regs[a[0]] = r & 0xFFFFFFFF
    return regs


@pytest.mark.parametrize("form", sorted(mx.PTX_DECODES))
def test_mxfp4_ptx_decode_is_exact(form):
    """`mx.PTX_DECODES[form]` (modelled instruction by instruction) and its jnp twin give e2m1 · 2^(S−127) exactly for
    every byte and E8M0 codes 2..248; in the PTX, $0..$3 = lo(b0,b1), lo(b2,b3), hi(b0,b1), hi(b2,b3)."""
    scales = [2, 60, 100, 118, 127, 128, 140, 200, 248]
    h = np.asarray(mx.scale_half_bf16(jnp.asarray(scales, jnp.uint8))).view(np.uint16).astype(np.int64)
    for S, hs in zip(scales, h):
        for w0 in range(256):  # every byte in every position, next to bytes of other signs and magnitudes
            b = np.array([w0, (37 * w0 + 11) % 256, (101 * w0 + 7) % 256, 255 - w0])
            regs = _run_ptx(mx.PTX_DECODES[form], {"$4": int(b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24),
                                                   "$5": hs | hs << 16, "$6": hs | hs << 16})
            got = np.array([regs[f"${i}"] for i in range(4)], np.uint32).view(np.uint16)
            want = np.concatenate([mx.E2M1_VALUES[b & 15], mx.E2M1_VALUES[b >> 4]]) * 2.0 ** (S - 127)
            np.testing.assert_array_equal(got.view(jnp.bfloat16).astype(np.float64), want, err_msg=f"S={S}")
    p = jnp.tile(jnp.arange(256, dtype=jnp.uint8), (len(scales), 1))
    lo, hi = mx.decode_lo_hi_bf16_ref(p, jnp.broadcast_to(mx.scale_half_bf16(jnp.asarray(scales, jnp.uint8))[:, None],
                                                           p.shape))
    mult = 2.0 ** (np.asarray(scales)[:, None] - 127.0)
    np.testing.assert_array_equal(np.asarray(lo, np.float64), mx.E2M1_VALUES[np.arange(256) & 15][None] * mult)
    np.testing.assert_array_equal(np.asarray(hi, np.float64), mx.E2M1_VALUES[np.arange(256) >> 4][None] * mult)


def test_mxfp4_ptx_decode_with_constant_operands_is_exact():
    """`mx.DECODE_PTX_SIGN_OPERANDS` (the Mosaic GPU kernel's decode: table, 0x43 bytes, h and −192·h as operands,
    −192·h from `mx.NEG192_PTX`), modelled instruction by instruction: e2m1 · 2^(S−127) exactly for every byte in every
    position of its word, and E8M0 codes 2..248; $0..$3 = lo(b0,b1), lo(b2,b3), hi(b0,b1), hi(b2,b3)."""
    scales = [2, 60, 100, 118, 127, 128, 140, 200, 248]
    h = np.asarray(mx.scale_half_bf16(jnp.asarray(scales, jnp.uint8))).view(np.uint16).astype(np.int64)
    for S, hs in zip(scales, h):
        h2 = int(hs | hs << 16)
        c2 = _run_ptx(mx.NEG192_PTX, {"$1": h2})["$0"]
        for w0 in range(256):
            b = np.array([w0, (37 * w0 + 11) % 256, (101 * w0 + 7) % 256, 255 - w0])
            regs = _run_ptx(mx.DECODE_PTX_SIGN_OPERANDS, {
                "$4": int(b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24), "$5": h2, "$6": c2,
                "$7": mx.LUT_POS[0], "$8": mx.LUT_POS[1], "$9": 0x43434343})
            got = np.array([regs[f"${i}"] for i in range(4)], np.uint32).view(np.uint16)
            want = np.concatenate([mx.E2M1_VALUES[b & 15], mx.E2M1_VALUES[b >> 4]]) * 2.0 ** (S - 127)
            np.testing.assert_array_equal(got.view(jnp.bfloat16).astype(np.float64), want, err_msg=f"S={S}")


def test_mxfp4_placed_decode_is_exact():
    """The "placed" layout: `mx.place_codes` permutes each word's bits, and `mx.DECODE_PTX_PLACED` (shifts, masks
    and one bf16x2 multiply by `scale_placed_bf16`, modelled instruction by instruction) gives e2m1 · 2^(S−127)
    exactly for every byte in every position of its word and E8M0 codes 1..128; $0..$3 = lo(b0,b1), lo(b2,b3),
    hi(b0,b1), hi(b2,b3) of the natural word. Code 0 of the scale is a zero scale (as `scale_f32`)."""
    assert sorted(mx.PLACED_SOURCES) == list(range(32))
    scales = [0, 1, 2, 60, 100, 118, 127, 128]
    h = np.asarray(mx.scale_placed_bf16(jnp.asarray(scales, jnp.uint8))).view(np.uint16).astype(np.int64)
    natural = np.array([[w0, (37 * w0 + 11) % 256, (101 * w0 + 7) % 256, 255 - w0] for w0 in range(256)], np.uint8)
    placed = np.asarray(mx.place_codes(jnp.asarray(natural))).astype(np.int64)
    for S, hs in zip(scales, h):
        mult = 0.0 if S == 0 else 2.0 ** (S - 127)
        for b, pb in zip(natural, placed):
            regs = _run_ptx(mx.DECODE_PTX_PLACED, {"$4": int(pb[0] | pb[1] << 8 | pb[2] << 16 | pb[3] << 24),
                                                   "$5": int(hs | hs << 16)})
            got = np.array([regs[f"${i}"] for i in range(4)], np.uint32).view(np.uint16)
            want = np.concatenate([mx.E2M1_VALUES[b & 15], mx.E2M1_VALUES[b >> 4]]) * mult
            np.testing.assert_array_equal(got.view(jnp.bfloat16).astype(np.float64), want, err_msg=f"S={S}")
    with pytest.raises(ValueError, match="whole 32-bit words"):
        mx.place_codes(jnp.zeros((2, 6), jnp.uint8))


def test_mxfp4_e4m3_ptx_decode_is_exact():
    """`mx.DECODE_E4M3_PTX` (modelled instruction by instruction) and its jnp twin turn every byte, in every position of
    its register, into the e4m3 codes of 2^−6 · e2m1 of its low ($0) and high ($1) nibble; −0 for code 8."""
    import ml_dtypes

    want_lo = (mx.E2M1_VALUES[np.arange(256) & 15] * 2.0 ** -6).astype(ml_dtypes.float8_e4m3fn)
    want_hi = (mx.E2M1_VALUES[np.arange(256) >> 4] * 2.0 ** -6).astype(ml_dtypes.float8_e4m3fn)
    assert np.array_equal(want_lo.astype(np.float64) * 64, mx.E2M1_VALUES[np.arange(256) & 15])  # exact
    for w0 in range(256):
        b = np.array([w0, (37 * w0 + 11) % 256, (101 * w0 + 7) % 256, 255 - w0])
        regs = _run_ptx(mx.DECODE_E4M3_PTX, {"$2": int(b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24)})
        for out, want in (("$0", want_lo), ("$1", want_hi)):
            got = np.array([regs[out]], np.uint32).view(np.uint8)
            np.testing.assert_array_equal(got, want[b].view(np.uint8), err_msg=f"{out} byte {w0}")
    lo, hi = mx.decode_lo_hi_e4m3_ref(jnp.arange(256, dtype=jnp.uint8))  # the jnp twin
    np.testing.assert_array_equal(np.asarray(lo).view(np.uint8), want_lo.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(hi).view(np.uint8), want_hi.view(np.uint8))
    assert want_lo.view(np.uint8)[8] == 0x80  # code 8 is −0


def test_x_as_two_e4m3_planes():
    """x ≈ (hi + lo) · inv per row, |x·c| < 128, within 2^−8 relative per element (plus the subnormal step), inv a
    power of two; zero rows stay zero — eager and under jit (where XLA on the GPU once folded the split's converts)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 96)) * np.array([1e-30, 1e-3, 1.0, 7.0, 1e4, 0.0])[:, None]
    x[2, 5] = 300.0  # one large element sets its row's scale
    x32 = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    for split in (mx.split_e4m3_planes, jax.jit(mx.split_e4m3_planes)):
        hi, lo, inv = split(jnp.asarray(x, jnp.float32))
        assert hi.dtype == lo.dtype == jnp.float8_e4m3fn and inv.shape == (6,)
        inv = np.asarray(inv, np.float64)
        assert np.all(np.log2(inv) == np.round(np.log2(inv)))
        xs = x / inv[:, None]
        assert np.all(np.abs(xs) < 128)
        back = (np.asarray(hi, np.float64) + np.asarray(lo, np.float64)) * inv[:, None]
        assert np.all(np.abs(back - x32) <= 2.0 ** -8 * np.abs(x32) + 2.0 ** -10 * inv[:, None])
        assert not back[5].any()


CONFIGS = {
    ("tpu", "bf16"): tpu.TpuConfig(bm=32, bn=128, bk=128),
    ("tpu", "mxfp4"): tpu.TpuConfig(bm=32, bn=128, bk=256),
}


@pytest.mark.parametrize("backend", ["tpu"])  # the GPU kernel: tests/test_triton_moe.py
@pytest.mark.parametrize("kind", ["bf16", "mxfp4"])
def test_grouped_matmul_kernels_match_ragged_dot(backend, kind):
    """bf16 inputs, several contraction steps, an empty group and uncovered tail rows (must come out as zeros)."""
    E, K, N = len(SIZES), 512, 128
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((M_ROWS, K)), jnp.bfloat16)
    if kind == "bf16":
        w = jnp.asarray(rng.standard_normal((E, K, N)) / 20, jnp.bfloat16)
        w_ref = w
    else:
        w = mx.random_weight(jax.random.key(3), E, K, N)
        w_ref = mx.dequantize(w, jnp.bfloat16)
    gs = jnp.asarray(SIZES, jnp.int32)
    want = jax.jit(reference.grouped_matmul)(x, w_ref, gs)
    got = jax.jit(functools.partial(ops.grouped_matmul, backend=backend, interpret=True,
                                    config=CONFIGS[backend, kind]))(x, w, gs)
    assert got.shape == (M_ROWS, N) and got.dtype == jnp.float32
    assert _rel(got, want) < 1e-5
    assert not np.asarray(got[sum(SIZES):]).any()


@pytest.mark.parametrize("backend", ["interpret", pytest.param("gpu", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("n_w", [1, 2])
def test_gpu_mixed_tile_heights_equal_the_reference(backend, n_w):
    """bm_small: a tile with at most bm_small rows (a group's last tile, a small group) takes the short MMA path —
    tails under, at and over bm_small, full tiles, an empty group and uncovered rows (zeros) give ragged_dot's
    result, for one weight and for two (gate, up) through the fused activation."""
    bm, bm_small = (32, 16) if backend == "interpret" else (128, 64)
    u = bm_small // 16
    sizes = [bm + u, 0, bm_small, bm_small + 1, 2 * bm + 6 * u, 5, bm, 3 * u]
    E, K, N = len(sizes), 256, 128
    M = sum(sizes) + 7
    x = jax.random.normal(jax.random.key(13), (M, K), jnp.bfloat16)
    ws = [(jax.random.normal(jax.random.key(14 + i), (E, K, N), jnp.float32) * K ** -0.5).astype(jnp.bfloat16)
          for i in range(n_w)]
    gs = jnp.asarray(sizes, jnp.int32)
    act = (lambda a, b: a * jax.nn.sigmoid(a) * b) if n_w == 2 else None
    outs = [reference.grouped_matmul(x, w, gs) for w in ws]
    want = act(*outs) if n_w == 2 else outs[0]
    cfg = GpuConfig(bm=bm, bn=64, bk=64, num_warps=4, num_stages=2, bm_small=bm_small)
    got = jax.jit(lambda a, g, *w: gpu_triton.grouped_matmul(a, tuple(w), g, activation=act, config=cfg,
                                                             interpret=backend == "interpret"))(x, gs, *ws)
    assert _rel(got, want) < 1e-5
    assert not np.asarray(got[sum(sizes):]).any()
    with pytest.raises(ValueError, match="bm_small"):
        gpu_triton.grouped_matmul(x, tuple(ws), gs, activation=act, config=dataclasses.replace(cfg, bm_small=bm),
                                  interpret=True)


def _ffn_case(kind, seed=6):
    N, D, F, E, k = (48, 256, 128, 8, 2) if kind == "bf16" else (24, 128, 64, 4, 2)
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((N, D)), jnp.bfloat16)
    idx = jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(N)]), jnp.int32)
    idx = idx.at[:5].set(jnp.asarray([0, 1], jnp.int32))  # a few repeats so some experts get more rows
    wt = jnp.asarray(rng.random((N, k)), jnp.float32)
    if kind == "bf16":
        ws = [jnp.asarray(rng.standard_normal(s) / np.sqrt(s[1]), jnp.bfloat16)
              for s in ((E, D, F), (E, D, F), (E, F, D))]
        ws_ref = ws
    else:
        keys = jax.random.split(jax.random.key(seed), 3)
        ws = [mx.random_weight(keys[0], E, D, F), mx.random_weight(keys[1], E, D, F),
              mx.random_weight(keys[2], E, F, D)]
        ws_ref = [mx.dequantize(w, jnp.bfloat16) for w in ws]
    return x, idx, wt, ws, ws_ref


@pytest.mark.parametrize("backend,kind", [("tpu", "bf16")])  # the GPU kernel: tests/test_triton_moe.py
def test_fused_expert_ffn_matches_reference_and_is_deterministic(backend, kind):
    x, idx, wt, ws, ws_ref = _ffn_case(kind)
    want = reference.expert_ffn(x, idx, wt, *ws_ref, situ)
    f = jax.jit(lambda *a: ops.expert_ffn(*a, situ, backend=backend, interpret=True, fuse=True))
    got = f(x, idx, wt, *ws)
    assert got.shape == want.shape and got.dtype == jnp.float32
    assert _rel(got, want) < 2e-2  # h is rounded to bf16 after differently ordered fp32 sums
    again = f(x, idx, wt, *ws)
    assert np.array_equal(np.asarray(got).view(np.int32), np.asarray(again).view(np.int32))


@pytest.mark.parametrize("tokens, k, experts", [(224, 16, 112), (3, 16, 896), (0, 16, 8), (40, 4, 3),
                                                (ops.COUNTING_SORT_MAX_PAIRS // 8 + 1, 8, 64)])
def test_dispatch_plan_is_the_stable_sort_by_expert(tokens, k, experts):
    """`ops.dispatch_plan` (counting ranks up to COUNTING_SORT_MAX_PAIRS pairs, the reference sort past it) gives
    argsort's stable order: by expert, then by (token, slot); rows of one token follow its slots. Repeated
    experts in a token (40 × 4 over 3 experts) keep slot order too. `sort_tokens` is its first three outputs."""
    rng = np.random.default_rng(tokens)
    if k <= experts:
        idx = np.stack([rng.choice(experts, k, replace=False) for _ in range(tokens)]).reshape(tokens, k)
    else:
        idx = rng.integers(0, experts, (tokens, k))
    order, token_of_row, sizes, slot_row = jax.jit(ops.dispatch_plan, static_argnums=1)(jnp.asarray(idx, jnp.int32),
                                                                                         experts)
    flat = idx.reshape(-1)
    np.testing.assert_array_equal(order, np.argsort(flat, kind="stable"))
    np.testing.assert_array_equal(slot_row, np.argsort(np.argsort(flat, kind="stable")))  # order's inverse
    np.testing.assert_array_equal(token_of_row, np.argsort(flat, kind="stable") // k)
    np.testing.assert_array_equal(sizes, np.bincount(flat, minlength=experts))
    assert order.dtype == token_of_row.dtype == sizes.dtype == jnp.int32


@pytest.mark.parametrize("backend", ["reference", "gpu", "tpu"])
@pytest.mark.parametrize("kind", ["bf16", "mxfp4"])
def test_no_rows_give_empty_outputs(backend, kind):
    """M = 0 rows (an expert shard that received no tokens) is a legal call: grouped_matmul returns [0, N] and
    expert_ffn [0, D] on every backend (the TPU kernel's schedule used to address row block −1; the combine could
    not reshape zero tokens)."""
    E, D, F = 3, 64, 32
    x = jnp.zeros((0, D), jnp.bfloat16)
    keys = jax.random.split(jax.random.PRNGKey(5), 3)
    if kind == "mxfp4":
        ws = [mx.random_weight(keys[0], E, D, F), mx.random_weight(keys[1], E, D, F), mx.random_weight(keys[2], E, F, D)]
    else:
        ws = [jax.random.normal(kk, s, jnp.bfloat16) for kk, s in zip(keys, [(E, D, F), (E, D, F), (E, F, D)])]
    out = ops.grouped_matmul(x, ws[0], jnp.zeros((E,), jnp.int32), backend=backend, interpret=True)
    assert out.shape == (0, F)
    y = ops.expert_ffn(x, jnp.zeros((0, 2), jnp.int32), jnp.zeros((0, 2)), *ws, situ, backend=backend,
                       interpret=True)
    assert y.shape == (0, D) and y.dtype == jnp.float32


def test_reference_backend_is_deterministic_and_routes_like_the_module():
    from kimi_jax.config import MoEConfig
    from kimi_jax.modules.moe import route

    cfg = MoEConfig(num_experts=8, top_k=2, intermediate_size=128, num_groups=2, topk_groups=1,
                    routed_scaling_factor=2.5)
    x, _, _, ws, _ = _ffn_case("bf16", seed=7)
    rng = np.random.default_rng(7)
    router = jnp.asarray(rng.standard_normal((x.shape[1], 8)) / 16, jnp.float32)
    bias = jnp.asarray(rng.standard_normal(8) / 10, jnp.float32)
    a = ops.routed_experts(x, router, bias, cfg, *ws, situ, backend="reference")
    b = ops.routed_experts(x, router, bias, cfg, *ws, situ, backend="reference")
    assert np.array_equal(np.asarray(a).view(np.int32), np.asarray(b).view(np.int32))
    w, idx = route(x, router, bias, cfg)
    np.testing.assert_allclose(a, reference.expert_ffn(x, idx, w, *ws, situ), rtol=1e-5, atol=1e-5)


def test_kernels_lower_for_tpu():
    """Lowering (not compiling) for the real target: Mosaic TPU is built on CPU (the GPU kernel's sm_90 compile:
    tests/test_triton_compile.py)."""
    x = jnp.zeros((256, 512), jnp.bfloat16)
    gs = jnp.asarray([100, 0, 156], jnp.int32)
    dense = jnp.zeros((3, 512, 256), jnp.bfloat16)
    q = mx.random_weight(jax.random.key(0), 3, 512, 256)
    for ws in [(dense,), (q,), (dense, dense), (q, q)]:
        act = situ if len(ws) == 2 else None
        f = lambda a, g, ws=ws, act=act: tpu.grouped_matmul(a, ws, g, activation=act,  # noqa: E731
                                                            config=tpu.TpuConfig(bm=64, bn=128, bk=256))
        assert "tpu_custom_call" in jax.jit(f).trace(x, gs).lower(lowering_platforms=("tpu",)).as_text()


EP_SCRIPT = textwrap.dedent("""
    import numpy as np, jax, jax.numpy as jnp
    from kimi_jax.config import MoEConfig
    from kimi_jax.modules.moe import route
    from pallas_kernels.moe import reference
    from sharding import make_mesh
    from sharding.expert_parallel import ep_expert_ffn, ep_moe
    assert len(jax.devices()) == 8
    import ep_cases
    from ep_cases import situ
    N, D, F, E, k = 64, 128, 64, 16, 4
    rng, x, idx, wt, wg, wu, wd, ref = ep_cases.routed_case(N, D, F, E, k, gate_scale=11, down_scale=8)
    check = lambda tag, out, tol=1e-5: ep_cases.check(tag, out, ref, tol)
    for spec in ("2x4", "8x1"):
        mesh = make_mesh(spec)
        for method in ("allgather", "ragged"):
            run = lambda: ep_expert_ffn(x, idx, wt, wg, wu, wd, situ, mesh=mesh, method=method,
                                        backend="reference", emulate_a2a=True)
            out = run()
            assert len(out.sharding.device_set) == 8
            check(f"{spec} {method}", out)
            assert np.array_equal(np.asarray(out), np.asarray(run())), "not deterministic"
    mesh = make_mesh("8x1")
    out = ep_expert_ffn(x.astype(jnp.bfloat16), idx, wt, wg.astype(jnp.bfloat16), wu.astype(jnp.bfloat16),
                        wd.astype(jnp.bfloat16), situ, mesh=mesh, method="allgather", backend="gpu", interpret=True)
    check("8x1 allgather gpu-kernel", out, tol=3e-2)
    # tokens that do not split over data x model stay replicated over "model" (psum)
    mesh = make_mesh("2x4")
    out = ep_expert_ffn(x[:60], idx[:60], wt[:60], wg, wu, wd, situ, mesh=mesh, backend="reference")
    err = float(np.abs(np.asarray(out) - ref[:60]).max() / np.abs(ref).max())
    assert err < 1e-5, err
    print("replicated tokens ok", err)
    cfg = MoEConfig(num_experts=E, top_k=k, intermediate_size=F, num_groups=4, topk_groups=2)
    router = jnp.asarray(rng.standard_normal((D, E)) / 10, jnp.float32)
    bias = jnp.asarray(rng.standard_normal(E) / 10, jnp.float32)
    w, i = route(x, router, bias, cfg)
    want = np.asarray(reference.expert_ffn(x, i, w, wg, wu, wd, situ))
    out = ep_moe(x, router, bias, cfg, wg, wu, wd, situ, mesh=mesh, method="ragged", backend="reference",
                 emulate_a2a=True)
    err = float(np.abs(np.asarray(out) - want).max() / np.abs(want).max())
    assert err < 1e-5, err
    print("ep_moe ok", err)
""")


def test_expert_parallel_on_8_devices_matches_one_device():
    env = cpu_devices_env(8,
               PYTHONPATH=os.pathsep.join([ROOT, TESTS, os.environ.get("PYTHONPATH", "")]))  # ep_cases
    out = subprocess.run([sys.executable, "-c", EP_SCRIPT], env=env, capture_output=True, text=True, timeout=600,
                         cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    for tag in ("2x4 allgather", "2x4 ragged", "8x1 allgather", "8x1 ragged", "8x1 allgather gpu-kernel",
                "replicated tokens", "ep_moe"):
        assert f"{tag} ok" in out.stdout, out.stdout


def test_mxfp4_checkpoint_loads_packed_and_matches_dequantised(tmp_path):
    """A tiny K3.1 checkpoint with MXFP4 experts, converted (`--dtype keep`) and loaded: the routed experts stay
    uint8 model parameters in the checkpoint's own layout (no dequantised copy), the plan's MXFP4 byte count is
    what is held, and the logits equal those of the model loaded with the experts dequantised at load time — on
    the reference backend (dequantise per call inside the jitted forward) and through the GPU kernel (interpreted).
    Loading the Hugging Face directory directly keeps them packed as well."""
    from kimi_jax.checkpoint import convert_checkpoint as convert
    from convert.synthetic import write_k3_checkpoint
    from kimi_jax import checkpoint
    from kimi_jax.config import get_preset
    from kimi_jax.kernels import KernelConfig
    from kimi_jax.model import _flat, abstract_params
    from kimi_jax.plan import count_params, weight_bytes

    cfg = get_preset("tiny")  # latent width 64: MXFP4 groups of 32 divide it
    hf, conv = tmp_path / "hf", tmp_path / "jax"
    write_k3_checkpoint(str(hf), cfg, seed=1, dtype="F32", shard_bytes=200_000)
    convert(str(hf), str(conv), dtype="keep", progress=False)

    ref = KernelConfig(moe="reference")  # bit-for-bit comparisons on any platform
    packed = checkpoint.load(str(conv), kernels=ref)
    plain = checkpoint.load(str(conv), mxfp4_experts="dequantize", kernels=ref)
    flat_q, flat_p = _flat(packed.params), _flat(plain.params)
    moe_layers = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
    assert moe_layers
    E, F, L = cfg.moe.num_experts, cfg.moe.intermediate_size, cfg.moe.latent_size
    for i in moe_layers:
        pre = f"layers.{i}.block_sparse_moe.experts."
        assert not any(k in flat_q for k in (pre + "gate", pre + "up", pre + "down"))
        for w, (n, k) in (("gate", (F, L)), ("up", (F, L)), ("down", (L, F))):
            assert flat_q[pre + w + ".packed"].dtype == jnp.uint8 and flat_q[pre + w + ".packed"].shape == (E, n, k // 2)
            assert flat_q[pre + w + ".scale"].dtype == jnp.uint8 and flat_q[pre + w + ".scale"].shape == (E, n, k // 32)
            assert flat_p[pre + w].dtype == jnp.float32
    # abstract_params / param_count describe the logical (plain) model; the plan's "release" bytes for the routed
    # experts are exactly the packed + scale bytes the loaded model holds
    assert set(abstract_params(cfg)) == set(flat_p)
    counts = count_params(cfg)
    routed = {k: n for k, n in counts["sizes"].items() if ".block_sparse_moe.experts." in k}
    held = sum(v.size for k, v in flat_q.items() if k.endswith((".packed", ".scale")))
    assert weight_bytes(cfg, routed, "release") == held

    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 9))
    want = plain.logits(ids)
    np.testing.assert_array_equal(packed.logits(ids), want)  # same values, same ragged_dot: same bits
    direct = checkpoint.load(str(hf), kernels=ref)
    assert _flat(direct.params)[f"layers.{moe_layers[0]}.block_sparse_moe.experts.gate.packed"].dtype == jnp.uint8
    np.testing.assert_array_equal(direct.logits(ids), want)
    kern = checkpoint.load(str(conv), kernels=KernelConfig(moe="gpu", moe_interpret=True))
    np.testing.assert_allclose(kern.logits(ids), want, rtol=0, atol=1e-4 * float(np.abs(want).max()))


def _device_mxfp4_case():
    """The MXFP4 GPU tests' case: groups of 8, 0, 70, 3, 8, 16, 1 and 30 rows (decode-sized and larger, an empty
    one) plus 8 uncovered tail rows; ragged_dot over the exactly dequantised weights as the reference."""
    sizes = [8, 0, 70, 3, 8, 16, 1, 30]
    E, K, N, M = len(sizes), 1024, 512, 160
    x = jax.random.normal(jax.random.key(11), (M, K), jnp.bfloat16)
    w = mx.random_weight(jax.random.key(12), E, K, N)
    gs = jnp.asarray(sizes, jnp.int32)
    want = jax.jit(reference.grouped_matmul)(x, mx.dequantize(w, jnp.bfloat16), gs)
    return sizes, x, w, gs, want


# --------------------------------------------------------------- the Mosaic GPU MXFP4 kernel (pallas_kernels.moe.mgpu_mxfp4)

def test_mgpu_contraction_order_is_a_permutation_per_64_byte_block():
    """x's packed-column order for the Mosaic GPU kernel: a bijection within every 64-byte block, and thread quad q's
    16 contiguous bytes (one 32-element scale group) become logical columns (2q, 2q+1, 2q+8, 2q+9) of the four
    16-wide slabs — the A-operand fragment of lane q in each slab."""
    from pallas_kernels.moe import mgpu_mxfp4 as mm

    perm = mm.x_permutation(256)
    assert sorted(perm) == list(range(256))
    assert all(set(perm[b:b + 64]) == set(range(b, b + 64)) for b in range(0, 256, 64))
    inv = np.argsort(perm)  # physical byte -> logical column
    for q in range(4):
        logical = inv[16 * q:16 * q + 16].reshape(4, 4)  # word s, byte t
        for s in range(4):
            assert list(logical[s]) == [16 * s + 2 * q, 16 * s + 2 * q + 1, 16 * s + 2 * q + 8, 16 * s + 2 * q + 9]


def test_mgpu_row_preparation_reproduces_the_grouped_matmul():
    """The Mosaic GPU kernel's contract, computed in jnp on the CPU: per live 16-row tile t of `prepare_rows`, the
    weight planes of expert tile_group[t] in the permuted contraction order, times that tile's xe / xo rows, give
    the grouped matmul — padding, tile-to-group map, x permutation and the output gather together; likewise the
    fp8 path's `prepare_rows_fp8` (within the two-plane split's error)."""
    from pallas_kernels.moe import mgpu_mxfp4 as mm

    sizes = [8, 0, 37, 3, 16, 1]
    E, K, N, M = len(sizes), 256, 64, 70  # 5 uncovered tail rows
    x = jax.random.normal(jax.random.key(5), (M, K), jnp.bfloat16)
    w = mx.random_weight(jax.random.key(6), E, K, N)
    gs = jnp.asarray(sizes, jnp.int32)
    want = reference.grouped_matmul(x, mx.dequantize(w, jnp.bfloat16), gs)
    for rows in (16, 32):
        (xe, xo), tile_group, num_tiles, pad_row, live = mm.prepare_rows(x, gs, E, rows)
        assert int(num_tiles[0]) == sum(-(-s // rows) for s in sizes)
        padding = np.ones(xe.shape[0], bool)
        padding[np.asarray(pad_row)[np.asarray(live)]] = False
        assert not np.asarray(xe[padding]).any() and not np.asarray(xo[padding]).any()  # zeros between groups
        perm = mm.x_permutation(K // 2)
        lo, hi = mx.decode_lo_hi_f32(w.packed)  # [E, N, K/2] even / odd input elements, unscaled
        sc = jnp.repeat(mx.scale_f32(w.scale), mx.GROUP // 2, axis=-1)  # [E, N, K/2]: one scale per 16 bytes
        lo, hi = (lo * sc)[:, :, perm], (hi * sc)[:, :, perm]
        out_t = jnp.zeros((N, xe.shape[0]), jnp.float32)
        for t in range(int(num_tiles[0])):
            g, r = int(tile_group[t]), slice(t * rows, (t + 1) * rows)
            part = lo[g] @ xe[r].astype(jnp.float32).T + hi[g] @ xo[r].astype(jnp.float32).T
            out_t = out_t.at[:, r].set(part)
        got = jnp.where(live[:, None], out_t[:, pad_row].T, 0)
        assert _rel(got, want) < 1e-5
        assert not np.asarray(got[sum(sizes):]).any()
    # the fp8 path's contract: codes as e4m3 (2^-6 · e2m1), each group's [even | odd] elements, x as two e4m3
    # planes, the group scale times 2^6 on each group's partial, each row's 1/scale at the end
    lo8, hi8 = mx.decode_lo_hi_e4m3_ref(w.packed)
    G = mx.GROUP
    w8 = jnp.stack([lo8.astype(jnp.float32).reshape(E, N, K // G, G // 2),
                    hi8.astype(jnp.float32).reshape(E, N, K // G, G // 2)], axis=3).reshape(E, N, K)
    w8 = w8 * jnp.repeat(mx.scale_f32(w.scale, mx.E4M3_DECODE_EXP), G, axis=-1)
    from pallas_kernels.experimental import mxfp4_fp8_mma

    x_hi, x_lo, inv, tile_group, num_tiles, pad_row, live = mxfp4_fp8_mma.prepare_rows_fp8(x, gs, E, 16)
    xp = x_hi.astype(jnp.float32) + x_lo.astype(jnp.float32)
    out_t = jnp.zeros((N, xp.shape[0]), jnp.float32)
    for t in range(int(num_tiles[0])):
        r = slice(t * 16, (t + 1) * 16)
        out_t = out_t.at[:, r].set(w8[int(tile_group[t])] @ xp[r].T)
    got = jnp.where(live[:, None], out_t[:, pad_row].T * inv[pad_row][:, None], 0)
    assert _rel(got, want) < 3e-3


def test_mgpu_mxfp4_kernel_lowers_for_cuda():
    """The Mosaic GPU kernel lowers for CUDA (its inline decode builds the WGMMA-layout registers at lowering time);
    the custom call carries a Mosaic GPU module. Running it needs a Hopper GPU (the gpu-marked test below)."""
    from pallas_kernels.moe import mgpu_mxfp4 as mm

    E, K, N = 4, 512, 128
    x = jax.ShapeDtypeStruct((32, K), jnp.bfloat16)
    codes, scales_t = jax.ShapeDtypeStruct((E, N, K // 2), jnp.uint8), jax.ShapeDtypeStruct((E, K // 32, N), jnp.uint8)
    natural = mm.PreparedWeight(codes, scales_t)
    placed = mm.PreparedWeight(codes, scales_t, jax.ShapeDtypeStruct((E,), jnp.float32), layout="placed")
    gs = jax.ShapeDtypeStruct((E,), jnp.int32)
    for w, cfg in ((natural, mm.MgpuConfig()), (placed, mm.MgpuConfig()), (placed, mm.MgpuConfig(kh=256, rows=32)),
                   (placed, mm.MgpuConfig(rows=8, plan="kernel")), (natural, mm.default_config(8)),
                   (natural, mm.MgpuConfig(mma="fp8")), (natural, mm.MgpuConfig(mma="fp8", rows=8))):
        text = jax.jit(lambda a, b, g, cfg=cfg: mm.grouped_matmul(a, b, g, config=cfg)).trace(x, w, gs).lower(
            lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text
        placed_decode = w.layout == "placed" and cfg.mma == "bf16"  # else the table (bf16) or e4m3 shifts (fp8)
        assert ("mul.lo.u32" in text, "prmt.b32" in text) == (placed_decode, cfg.mma == "bf16" and not placed_decode)
    with pytest.raises(ValueError, match="layout='natural'"):
        jax.jit(lambda a, b, g: mm.grouped_matmul(a, b, g, config=mm.MgpuConfig(mma="fp8", rows=8))).trace(
            x, placed, gs)
    with pytest.raises(ValueError, match="layout must be one of"):
        mm.PreparedWeight(codes, scales_t, layout="swizzled")
    with pytest.raises(ValueError, match="plan must be 'kernel' or 'xla'"):
        mm.MgpuConfig(plan="host")
    with pytest.raises(ValueError, match="warpgroups must be 1 or one of"):
        mm.MgpuConfig(warpgroups=5)  # 2, 3 (K3's gate / up: 16 items of 192 columns) and 4 are taken
    with pytest.raises(ValueError, match="warp-specialised kernel"):
        mm.MgpuConfig(warpgroups=2, plan="kernel")


def test_warp_specialised_register_split_fits_the_ctas_pool():
    """A CTA of W compute warpgroups and one memory warpgroup launches with floor8(65536 / (128·(W + 1))) registers
    per thread, and `setmaxnreg` only moves registers within that pool: the compute warpgroups' increase plus the
    memory warpgroup's 40 must fit it, or the increase waits forever (W = 4 with JAX's own split: 4·112 + 40 = 488
    of 5·96 = 480, the session-22 hang). The traced kernel asks for exactly `ws_compute_registers`."""
    from pallas_kernels.moe import mgpu_mxfp4 as mm

    for W in mm.WS_WARPGROUPS:
        launch = 65536 // (128 * (W + 1)) // 8 * 8
        regs = mm.ws_compute_registers(W)
        assert W * regs + mm.WS_MEMORY_REGISTERS <= launch * (W + 1) and regs % 8 == 0
        assert W * (regs + 8) + mm.WS_MEMORY_REGISTERS > launch * (W + 1)  # and no fewer than fit
    assert [mm.ws_compute_registers(W) for W in (2, 3, 4)] == [232, 152, 104]
    sds = jax.ShapeDtypeStruct
    E, D, F = 4, 512, 256
    w = mm.PreparedWeight(sds((E, F, D // 2), jnp.uint8), sds((E, D // 32, F), jnp.uint8), sds((E,), jnp.float32))
    for W in mm.WS_WARPGROUPS:
        cfg = mm.MgpuConfig(rows=40, kh=64, steps=4, ctas_per_sm=1, plan="xla", warpgroups=W)
        n = 192 * 2 if W == 3 else F  # whole items of 64·W columns
        w_ = mm.PreparedWeight(sds((E, n, D // 2), jnp.uint8), sds((E, D // 32, n), jnp.uint8), sds((E,), jnp.float32))
        jaxpr = str(jax.make_jaxpr(lambda x, g, w_: mm.grouped_matmul(x, w_, g, config=cfg))(
            sds((40, D), jnp.bfloat16), sds((E,), jnp.int32), w_))
        asked = set(re.findall(r"set_max_registers_p\[action=(\w+)\] (\d+)", jaxpr))
        assert asked == {("increase", str(mm.ws_compute_registers(W))), ("decrease", "40")}, (W, asked)
    # the FFN with down on a config of its own: the fused kernel at W = 2, down at W = 4
    cfg = dataclasses.replace(mm.tiled_config(32), down_config=mm.MgpuConfig(
        rows=40, kh=64, steps=2, ctas_per_sm=1, plan="xla", warpgroups=4))
    w_down = mm.PreparedWeight(sds((E, D, F // 2), jnp.uint8), sds((E, F // 32, D), jnp.uint8), sds((E,), jnp.float32))
    jaxpr = str(jax.make_jaxpr(lambda x, g, a, b, c: mm.expert_ffn_tiled(x, g, a, b, c, situ, config=cfg))(
        sds((40, D), jnp.bfloat16), sds((E,), jnp.int32), w, w, w_down))
    increases = re.findall(r"set_max_registers_p\[action=increase\] (\d+)", jaxpr)  # each kernel: 2 pipelines
    assert list(dict.fromkeys(increases)) == ["232", "104"]


def _tiled_ffn_cuda_text(cfg, E=4, D=512, F=256, M=40, gate_up_order="natural", tokens=0):
    """The StableHLO text of the tile-layout FFN (SiTU between; placed weights, default E = 4, D = 512, F = 256,
    M = 40 rows; gate and up in `gate_up_order`; `tokens` > 0: the rows given as that many tokens and a row ->
    token map) lowered for CUDA with kernel config `cfg`."""
    from pallas_kernels.moe import mgpu_mxfp4 as mm

    sds = jax.ShapeDtypeStruct
    w_in = mm.PreparedWeight(sds((E, F, D // 2), jnp.uint8), sds((E, D // 32, F), jnp.uint8), sds((E,), jnp.float32),
                             layout="placed", out_order=gate_up_order)
    w_out = mm.PreparedWeight(sds((E, D, F // 2), jnp.uint8), sds((E, F // 32, D), jnp.uint8), sds((E,), jnp.float32),
                              layout="placed")
    if tokens:
        return jax.jit(lambda a, g, t, w1, w3, w2: mm.expert_ffn_tiled(a, g, w1, w3, w2, situ, config=cfg,
                                                                       token_of_row=t)).trace(
            sds((tokens, D), jnp.bfloat16), sds((E,), jnp.int32), sds((M,), jnp.int32), w_in, w_in, w_out).lower(
            lowering_platforms=("cuda",)).as_text()
    return jax.jit(lambda a, g, w1, w3, w2: mm.expert_ffn_tiled(a, g, w1, w3, w2, situ, config=cfg)).trace(
        sds((M, D), jnp.bfloat16), sds((E,), jnp.int32), w_in, w_in, w_out).lower(lowering_platforms=("cuda",)).as_text()


def test_mgpu_warp_specialised_kernel_lowers_for_cuda():
    """`MgpuConfig(warpgroups=W)`: a CTA of W compute warpgroups (64 of an item's 64·W columns each) and a memory
    warpgroup lowers for CUDA as one Mosaic GPU kernel per matmul, alone and inside the tile-layout FFN; a weight
    whose width is not whole 128-column items is refused, and the stages divide the K loop (`ws_stages`)."""
    from pallas_kernels.moe import mgpu_mxfp4 as mm

    for rows, kh, steps, gate_up in ((16, 128, 4, "separate"), (48, 64, 3, "separate"), (80, 128, 4, "fused")):
        text = _tiled_ffn_cuda_text(mm.MgpuConfig(rows=rows, kh=kh, steps=steps, ctas_per_sm=1, plan="xla",
                                                  warpgroups=2, gate_up=gate_up))
        # fused: gate, up and SiTU (its tanh and logistic in the epilogue) one warp-specialised kernel, down another
        kernels = 3 if gate_up == "separate" else 2
        assert text.count("stablehlo.custom_call @mosaic_gpu") == kernels and "mul.lo.u32" in text
        # the fused kernel writes h in bf16, the dtype down reads it in (no fp32 h written and converted)
        results = re.findall(r"stablehlo.custom_call @mosaic_gpu.*?-> tensor<\d+x(\d+)x(\w+)>", text)
        assert gate_up == "separate" or results == [("256", "bf16"), ("512", "f32")], results
        # gate / up in the down matmul's plane order: the fused kernel writes h as down's x planes
        # [2, m_pad, F / 2], which down reads as they are — no XLA transpose between them
        planes = _tiled_ffn_cuda_text(mm.MgpuConfig(rows=rows, kh=kh, steps=steps, ctas_per_sm=1, plan="xla",
                                                    warpgroups=2, gate_up=gate_up), gate_up_order="planes")
        assert planes.count("stablehlo.custom_call @mosaic_gpu") == kernels
        if gate_up == "fused":
            h_type = re.findall(r"stablehlo.custom_call @mosaic_gpu.*?-> tensor<(\d+)x(\d+)x(\d+)x(\w+)>", planes)[0]
            assert (h_type[0], h_type[2:]) == ("2", ("128", "bf16")) and int(h_type[1]) % rows == 0, h_type
            between = planes.split("@mosaic_gpu", 2)[1]  # from the fused kernel to down
            assert "stablehlo.transpose" not in between
    E, D = 4, 512
    sds = jax.ShapeDtypeStruct
    assert (mm.ws_stages(14, 4), mm.ws_stages(7, 4), mm.ws_stages(12, 4), mm.ws_stages(2, 4)) == (2, 1, 4, 2)
    # four warpgroups, 16 rows, 128-byte steps: 42 KB per stage, so 7 of 14 steps do not fit; 2 do
    assert mm.ws_stages(14, 7, stage_bytes=256 * 128 + 8 * 256 + 2 * 16 * 128 * 2, fixed_bytes=4 * 16 * 64 * 4) == 2
    with pytest.raises(ValueError, match="does not fit"):
        mm.ws_stages(4, 4, stage_bytes=240_000)
    # a width that is not whole 64·W-column items: the last item is ragged (192 columns = 1½ items of 128; 3584 =
    # 18⅔ items of 192, K3's down); one that is not whole 64-column blocks is refused
    cfg = mm.MgpuConfig(rows=16, kh=128, plan="xla", warpgroups=2)
    for n, wgs in ((192, 2), (512, 3)):
        narrow = mm.PreparedWeight(sds((E, n, D // 2), jnp.uint8), sds((E, D // 32, n), jnp.uint8))
        ragged = dataclasses.replace(cfg, warpgroups=wgs)
        assert mm.supports(D, n, ragged)
        text = jax.jit(lambda a, tg, c, w, ragged=ragged: mm.kernel_call(a, tg, c, w, ragged)).trace(
            sds((2, 32, D // 2), jnp.bfloat16), sds((2,), jnp.int32), sds((1,), jnp.int32), narrow).lower(
            lowering_platforms=("cuda",)).as_text()
        assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
    bad = mm.PreparedWeight(sds((E, 160, D // 2), jnp.uint8), sds((E, D // 32, 160), jnp.uint8))
    assert not mm.supports(D, 160, cfg) and not mm.supports(D, 160, dataclasses.replace(cfg, warpgroups=1))
    with pytest.raises(ValueError, match="N=160 of 64"):
        jax.jit(lambda a, tg, n, w: mm.kernel_call(a, tg, n, w, cfg)).trace(
            sds((2, 32, D // 2), jnp.bfloat16), sds((2,), jnp.int32), sds((1,), jnp.int32), bad)


def test_mgpu_group_bounds():
    """The in-kernel plan's only XLA input: expert e's rows are [b[e], b[e + 1]), clipped to the M rows there are,
    and the last span [Σ sizes, M) is the rows the kernel zeroes."""
    from pallas_kernels.moe import mgpu_mxfp4 as mm

    b = mm.group_bounds(jnp.asarray([3, 0, 5, 2], jnp.int32), 12)
    assert list(np.asarray(b)) == [0, 3, 3, 8, 10, 12]
    b = mm.group_bounds(jnp.asarray([3, 6, 5], jnp.int32), 10)  # more rows routed than given: clipped at M
    assert list(np.asarray(b)) == [0, 3, 9, 10, 10]


def test_mgpu_placed_weight_keeps_every_value():
    """`prepare_weight(w, "placed")`: the codes are a bit permutation of each word (`mxfp4.PLACED_SOURCES`), and an
    expert with scale codes above 128 is lowered as a whole by its excess, which the output gets back as
    `out_scale` = 2^excess — so codes, lowered scales and that factor still dequantise to exactly the same weight."""
    from pallas_kernels.moe import mgpu_mxfp4 as mm

    E, K, N = 3, 128, 8
    w = mx.random_weight(jax.random.key(3), E, K, N)
    scale = np.asarray(w.scale).copy()
    scale[1] += 80  # codes 198..206: 2^(S−1) overflows bf16
    scale[2, 0, 0] = 0  # a zero scale stays zero
    w = mx.MXFP4Weight(w.packed, jnp.asarray(scale))
    p = mm.prepare_weight(w)
    offset = [0, scale[1].max() - 128, 0]
    assert p.layout == "placed" and list(np.asarray(p.out_scale)) == [2.0 ** o for o in offset]
    assert int(np.asarray(p.scales_t).max()) <= mm.PLACED_MAX_SCALE
    words = np.asarray(p.codes).view("<u4").astype(np.int64)  # [E, N, K/8]
    natural_words = sum(((words >> pos) & 1) << int(src) for pos, src in enumerate(mx.PLACED_SOURCES))
    natural = natural_words.astype("<u4").view(np.uint8).reshape(w.packed.shape)
    np.testing.assert_array_equal(natural, np.asarray(w.packed))
    scales_back = np.where(np.asarray(p.scales_t) == 0, 0,
                           np.asarray(p.scales_t) + np.asarray(offset)[:, None, None])
    np.testing.assert_array_equal(scales_back, np.swapaxes(scale, 1, 2))
    np.testing.assert_array_equal(np.asarray(mm.prepare_weight(w, "natural").codes), np.asarray(w.packed))
    with pytest.raises(ValueError, match="layout must be one of"):
        mm.prepare_weight(w, "swizzled")
    for layout in ("placed", "natural"):  # and back, bit for bit
        back = mm.unprepare_weight(mm.prepare_weight(w, layout))
        np.testing.assert_array_equal(np.asarray(back.packed), np.asarray(w.packed))
        np.testing.assert_array_equal(np.asarray(back.scale), scale)


def test_gate_up_columns_in_plane_order_make_h_the_down_planes():
    """A weight prepared with out_order="planes" stores its output columns permuted (`planes_column_order`) so
    that the activation of gate and up, moved in whole 64-column blocks (`columns_as_planes`), IS the down
    matmul's x planes (`_planes_in_contraction_order` of the natural h) — the fused kernel writes them directly.
    The permutation keeps every 128-column block; unprepare gives the checkpoint's weight back bit for bit;
    `prepare_ffn_weights` puts gate and up (not down) in that order when F is whole 128-column blocks."""
    from pallas_kernels.moe import mgpu_mxfp4 as mm

    for n in (128, 384):
        order = mm.planes_column_order(n)
        assert sorted(order) == list(range(n)) and (order // 128 == np.arange(n) // 128).all()
        h = jax.random.normal(jax.random.key(n), (5, n), jnp.float32)
        np.testing.assert_array_equal(np.asarray(mm.columns_as_planes(h[:, order])),
                                      np.asarray(mm._planes_in_contraction_order(h)))
    with pytest.raises(ValueError, match="not whole blocks of 128"):
        mm.planes_column_order(192)
    E, K, N = 3, 128, 256
    w = mx.random_weight(jax.random.key(4), E, K, N)
    wn = np.asarray(mx.dequantize(w, jnp.float32))  # [E, K, N]
    for layout in ("placed", "natural"):
        p = mm.prepare_weight(w, layout, "planes")
        assert p.out_order == "planes"
        back = mm.unprepare_weight(p)
        np.testing.assert_array_equal(np.asarray(back.packed), np.asarray(w.packed))
        np.testing.assert_array_equal(np.asarray(back.scale), np.asarray(w.scale))
        natural = mm.prepare_weight(w, layout)
        stored = mm.unprepare_weight(dataclasses.replace(p, out_order="natural"))  # the columns as stored
        np.testing.assert_array_equal(np.asarray(mx.dequantize(stored, jnp.float32)),
                                      wn[:, :, mm.planes_column_order(N)])
        assert natural.out_order == "natural"
    with pytest.raises(ValueError, match="out_order must be one of"):
        mm.prepare_weight(w, "placed", "columns")
    w_down = mx.random_weight(jax.random.key(5), E, N, K)
    assert [q.out_order for q in mm.prepare_ffn_weights(w, w, w_down)] == ["planes", "planes", "natural"]
    w_narrow = mx.random_weight(jax.random.key(6), E, K, 64)  # F = 64: not whole 128-column blocks
    w_down64 = mx.random_weight(jax.random.key(7), E, 64, K)
    assert [q.out_order for q in mm.prepare_ffn_weights(w_narrow, w_narrow, w_down64)] == ["natural"] * 3
    gs = jnp.asarray([2, 1, 0], jnp.int32)
    with pytest.raises(ValueError, match="gate and up need one output order"):
        mm.expert_ffn_tiled(jnp.zeros((3, K), jnp.bfloat16), gs, mm.prepare_weight(w, out_order="planes"),
                            mm.prepare_weight(w), mm.prepare_weight(w_down), situ)


def test_ops_take_prepared_weights_on_every_backend():
    """`ops` accepts a `mgpu_mxfp4.PreparedWeight` wherever it takes an MXFP4 weight: off the GPU (here: the
    reference backend) it runs as the unprepared weight, with the same bits as the `MXFP4Weight` it came from —
    for one grouped matmul and for the expert FFN with all three weights prepared."""
    from pallas_kernels.moe import mgpu_mxfp4 as mm

    sizes, E, K, N = [5, 0, 9, 2], 4, 256, 128
    x = jax.random.normal(jax.random.key(7), (sum(sizes) + 3, K), jnp.bfloat16)
    w = mx.random_weight(jax.random.key(8), E, K, N)
    gs = jnp.asarray(sizes, jnp.int32)
    want = ops.grouped_matmul(x, w, gs, backend="reference")
    for layout in ("placed", "natural"):
        for out_order in ("natural", "planes"):
            got = ops.grouped_matmul(x, mm.prepare_weight(w, layout, out_order), gs, backend="reference")
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    xf, idx, wt, ws, _ = _ffn_case("mxfp4")
    want = ops.expert_ffn(xf, idx, wt, *ws, situ, backend="reference")
    got = ops.expert_ffn(xf, idx, wt, *[mm.prepare_weight(mx.as_mxfp4(q)) for q in ws], situ, backend="reference")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _rows_of_planes(planes):
    """The inverse of `mgpu_mxfp4._planes_in_contraction_order`: x planes `[2, m, K/2]` -> rows `[m, K]`."""
    from pallas_kernels.moe import mgpu_mxfp4 as mm

    _, m, kh = planes.shape
    in_order = planes.reshape(2, m, kh // 64, 64).transpose(1, 2, 0, 3).reshape(m, 2 * kh)  # columns_as_planes⁻¹
    return in_order[:, np.argsort(mm.planes_column_order(2 * kh))]


def _reference_tiled_matmul(x_pad, plan, w, cfg, out_dtype=jnp.float32):
    """What `mgpu_mxfp4.tiled_matmul` computes, by definition: padded row p (x_pad given as rows, or as the planes
    a fused kernel writes) times its tile's expert's weight (the exactly dequantised codes), fp32, rounded to
    `out_dtype`, the columns in the weight's stored order."""
    from pallas_kernels.moe import mgpu_mxfp4 as mm

    if x_pad.ndim == 3:
        x_pad = _rows_of_planes(x_pad)
    wd = mx.dequantize(mm.unprepare_weight(w), jnp.float32)  # [E, K, N]
    if w.out_order == "planes":
        wd = wd[:, :, mm.planes_column_order(w.out_features)]
    expert_of_row = jnp.repeat(plan.tile_group, cfg.rows)
    return jnp.einsum("pk,pkn->pn", x_pad.astype(jnp.float32), wd[expert_of_row]).astype(out_dtype)


def _reference_tiled_gated_matmul(x_pad, plan, w_gate, w_up, activation, cfg, out_dtype=jnp.float32):
    """What `mgpu_mxfp4.tiled_gated_matmul` computes, by definition: the activation of the two tile-layout
    products, rounded to `out_dtype` — as the down matmul's x planes for weights with out_order="planes"."""
    from pallas_kernels.moe import mgpu_mxfp4 as mm

    h = activation(_reference_tiled_matmul(x_pad, plan, w_gate, cfg), _reference_tiled_matmul(x_pad, plan, w_up, cfg))
    h = h.astype(out_dtype)
    return mm.columns_as_planes(h) if w_gate.out_order == "planes" else h


@pytest.mark.parametrize("sizes,extra", [([5, 0, 9, 2], 3), ([0, 0, 0, 0], 4), ([8, 8, 8, 8], 0), ([1, 17, 0, 3], 0)])
def test_tiled_expert_ffn_layout_matches_the_sorted_ffn(sizes, extra):
    """The tile-layout FFN's plumbing (pad once, gate / up / act / down on padded rows, one gather back) with the
    kernel swapped for its definition: equal to the reference FFN on the same sorted rows, zeros past Σ sizes —
    groups that fill whole tiles, empty groups, none at all, and one larger than two tiles."""
    from pallas_kernels.moe import mgpu_mxfp4 as mm

    M = sum(sizes) + extra
    E, D, F = 4, 128, 128
    keys = jax.random.split(jax.random.key(sum(sizes) + extra), 4)
    ws = [mx.random_weight(keys[0], E, D, F), mx.random_weight(keys[1], E, D, F), mx.random_weight(keys[2], E, F, D)]
    x = jax.random.normal(keys[3], (sum(sizes) + extra, D), jnp.bfloat16)
    gs = jnp.asarray(sizes, jnp.int32)
    want = ops.expert_ffn_sorted(x, gs, *ws, situ, backend="reference")
    # the sorted rows as tokens: each token feeds two rows (top-2), rows in a shuffled token order
    tokens = jax.random.normal(keys[3], ((M + 1) // 2, D), jnp.bfloat16)
    token_of_row = jnp.asarray(np.random.default_rng(M).permutation(np.arange(M) // 2), jnp.int32)
    want_tok = ops.expert_ffn_sorted(tokens[token_of_row], gs, *ws, situ, backend="reference")
    # each weight natural, or gate / up in the down matmul's plane order (h handed over as planes)
    for prepared in ([mm.prepare_weight(q) for q in ws], mm.prepare_ffn_weights(*ws)):
        for rows, gate_up, wgs in ((8, "separate", 1), (16, "separate", 1), (16, "fused", 2)):
            cfg = mm.MgpuConfig(rows=rows, kh=64, gate_up=gate_up, warpgroups=wgs)
            got = jax.jit(lambda a, g, *w: mm.expert_ffn_tiled(a, g, *w, situ, config=cfg,
                                                               matmul=_reference_tiled_matmul,
                                                               gated_matmul=_reference_tiled_gated_matmul))(
                x, gs, *prepared)
            assert got.shape == want.shape
            if sum(sizes):
                assert _rel(got, want) < 1e-2, rows  # h is rounded to bf16 on both sides; sums in another order
            assert not np.asarray(got[sum(sizes):]).any()
            # from the tokens: x's planes made on them, gathered as half-rows
            got = jax.jit(lambda a, g, t, *w: mm.expert_ffn_tiled(a, g, *w, situ, config=cfg, token_of_row=t,
                                                                  matmul=_reference_tiled_matmul,
                                                                  gated_matmul=_reference_tiled_gated_matmul))(
                tokens, gs, token_of_row, *prepared)
            if sum(sizes):
                assert _rel(got, want_tok) < 1e-2, rows
            assert got.shape == want.shape and not np.asarray(got[sum(sizes):]).any()
            if gate_up == "fused" and prepared[0].out_order == "planes":
                # rows asked for in another order (`ops.expert_ffn` asks for (token, slot) order), gathered from
                # the padded rows in one step: the same rows, bit for bit
                out_rows = jnp.asarray(np.random.default_rng(M + 1).permutation(M), jnp.int32)
                picked = jax.jit(lambda a, g, t, r, *w: mm.expert_ffn_tiled(
                    a, g, *w, situ, config=cfg, token_of_row=t, out_rows=r, matmul=_reference_tiled_matmul,
                    gated_matmul=_reference_tiled_gated_matmul))(tokens, gs, token_of_row, out_rows, *prepared)
                assert np.array_equal(np.asarray(picked), np.asarray(got)[np.asarray(out_rows)]), rows


@pytest.mark.parametrize("tokens, k, experts, rows", [(12, 4, 5, 8), (9, 3, 3, 16), (0, 4, 4, 8), (30, 2, 6, 8)])
def test_slot_tile_plan_is_the_sorted_plan_seen_from_the_pairs(tokens, k, experts, rows):
    """`slot_tile_plan` plans the tile layout from the routing itself (rows = the pairs in (token, slot) order):
    every padded row holds the pair that the sorted plan (`dispatch_plan` then `tile_plan`) puts there, each
    pair's padded row is its sorted row's, the tiles and their experts are the same — so the FFN on it gives the
    sorted path's (token, slot)-order rows bit for bit (kernels swapped for their definitions). Repeated experts
    in a token (9 × 3 over 3) and routings that leave experts empty are included."""
    from pallas_kernels.moe import mgpu_mxfp4 as mm

    rng = np.random.default_rng(tokens * 100 + k)
    idx = jnp.asarray(rng.integers(0, experts - 1 if experts > 4 else experts, (tokens, k)), jnp.int32)
    P = tokens * k
    order, token_of_row, sizes, slot_row = ops.dispatch_plan(idx, experts)
    sorted_plan = mm.tile_plan(sizes, P, experts, rows)
    plan = jax.jit(mm.slot_tile_plan, static_argnums=(1, 2))(idx, experts, rows)
    want_src = np.append(np.asarray(order), P)[np.asarray(sorted_plan.src)]  # sorted row -> its pair; P: none
    np.testing.assert_array_equal(plan.src, want_src)
    np.testing.assert_array_equal(plan.pad_row, np.asarray(sorted_plan.pad_row)[np.asarray(slot_row)])
    np.testing.assert_array_equal(plan.tile_group, sorted_plan.tile_group)
    np.testing.assert_array_equal(plan.num_tiles, sorted_plan.num_tiles)
    assert np.asarray(plan.live).all() and plan.src.dtype == plan.pad_row.dtype == jnp.int32
    if P == 0:
        return  # no rows: nothing to gather (`ops.expert_ffn` takes its sorted path, which returns [0, D])

    D, F = 128, 128
    keys = jax.random.split(jax.random.key(P + experts), 4)
    ws = [mx.random_weight(keys[0], experts, D, F), mx.random_weight(keys[1], experts, D, F),
          mx.random_weight(keys[2], experts, F, D)]
    x_nd = jax.random.normal(keys[3], (tokens, D), jnp.bfloat16)
    stand_ins = dict(matmul=_reference_tiled_matmul, gated_matmul=_reference_tiled_gated_matmul)
    for prepared, gate_up in (([mm.prepare_weight(q) for q in ws], "separate"), (mm.prepare_ffn_weights(*ws), "fused")):
        cfg = mm.MgpuConfig(rows=rows, kh=64, gate_up=gate_up, warpgroups=2 if gate_up == "fused" else 1)
        got = jax.jit(lambda a, p, *w: mm.expert_ffn_tiled(
            a, None, *w, situ, config=cfg, plan=p, token_of_row=jnp.arange(P, dtype=jnp.int32) // k,
            **stand_ins))(x_nd, plan, *prepared)
        want = jax.jit(lambda a, t, g, r, *w: mm.expert_ffn_tiled(
            a, g, *w, situ, config=cfg, token_of_row=t, out_rows=r, **stand_ins))(
            x_nd, token_of_row, sizes, slot_row, *prepared)
        assert got.shape == (P, D)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        # the pairs' tokens given as k (row i is token i // k, computed inside the gather): the same rows
        by_k = jax.jit(lambda a, p, *w: mm.expert_ffn_tiled(a, None, *w, situ, config=cfg, plan=p, token_of_row=k,
                                                            **stand_ins))(x_nd, plan, *prepared)
        np.testing.assert_array_equal(np.asarray(by_k), np.asarray(got))
    with pytest.raises(ValueError, match="does not fit"):
        mm.expert_ffn_tiled(x_nd, None, *prepared, situ, config=dataclasses.replace(cfg, rows=rows * 2 + 8),
                            plan=plan, token_of_row=jnp.arange(P, dtype=jnp.int32) // k, **stand_ins)


def test_tiled_config_and_the_ffn_lower_for_cuda():
    """The tile layout's config is the padded plan (one 16-row tile per router-sized group at <= 8 rows per expert
    on average), and the
    whole tile-layout FFN — three Mosaic kernels, the activation and the gathers — lowers for CUDA."""
    from pallas_kernels.moe import mgpu_mxfp4 as mm

    assert mm.tiled_config(8) == mm.MgpuConfig(rows=16, kh=256, steps=2, ctas_per_sm=3, plan="xla")
    assert all(mm.tiled_config(r).plan == "xla" and mm.tiled_config(r).rows >= r for r in (2, 16, 32, 64))
    # above 16 rows per expert a tile holds a router's typical group (mean ± its spread) whole, and the FFN runs on
    # the warp-specialised kernel with gate, up and SiTU fused — unless a width is not whole 128-column items
    assert (mm.tiled_config(32).rows, mm.tiled_config(64).rows, mm.tiled_config(146).rows) == (40, 80, 80)
    for r in (32, 64, 146):  # 146: a 16K-token prefill's load over 112 experts
        assert (mm.tiled_config(r).warpgroups, mm.tiled_config(r).gate_up) == (2, "fused")
        if r > 32:
            assert mm.tiled_config(r, (3072, 3584)) == mm.tiled_config(r)
    # up to 32 rows, K3's widths: gate / up fused on three warpgroups (3072 = 16 items of 192 columns), down on
    # two (3584 is not whole 192-column items); widths that are not whole 192-column items keep two
    k3 = mm.tiled_config(32, (3072, 3584))
    assert (k3.warpgroups, k3.gate_up, k3.down_config) == (3, "fused", mm.tiled_config(32))
    assert mm.tiled_config(24, (3072, 3584)) == k3 and mm.tiled_config(32, (2048, 3584)) == mm.tiled_config(32)
    # and `ops` sends K3's FFN down that path at every size: down is checked against its own config
    sds = jax.ShapeDtypeStruct
    E, D, F = 112, 3584, 3072
    w_in = mm.PreparedWeight(sds((E, F, D // 2), jnp.uint8), sds((E, D // 32, F), jnp.uint8), sds((E,), jnp.float32),
                             layout="placed", out_order="planes")
    w_out = mm.PreparedWeight(sds((E, D, F // 2), jnp.uint8), sds((E, F // 32, D), jnp.uint8), sds((E,), jnp.float32),
                              layout="placed")
    with mock.patch.object(jax, "default_backend", lambda: "gpu"):
        for r in (8, 24, 32, 64, 146):
            assert ops._tiled_ffn_takes(E * r, (w_in, w_in, w_out), "gpu", False, None), r
        narrow = mm.tiled_config(r, (3072, 3648))  # D = 3648: 57 blocks of 64 columns, not whole pairs
        one_wg_rows = mm.tiled_config(r).rows if r <= 64 else mm.default_config(r).rows  # prefill: default's tiles
        assert (narrow.warpgroups, narrow.rows) == (1, one_wg_rows)
    # fused: SiTU's tanh and logistic in the warp-specialised kernel's epilogue
    for cfg, kernels in ((mm.tiled_config(40 / 4), 3), (mm.tiled_config(64), 2)):
        text = _tiled_ffn_cuda_text(cfg)
        assert text.count("stablehlo.custom_call @mosaic_gpu") == kernels, cfg
    with pytest.raises(ValueError, match="gate_up must be"):
        mm.MgpuConfig(gate_up="both")
    with pytest.raises(ValueError, match="gate_up='fused' runs on the warp-specialised kernel"):
        mm.MgpuConfig(gate_up="fused")  # one warpgroup per CTA: no fused kernel
    # down on a kernel config of its own: four warpgroups after the fused two-warpgroup kernel
    text = _tiled_ffn_cuda_text(dataclasses.replace(mm.tiled_config(32), down_config=mm.MgpuConfig(
        rows=40, kh=64, steps=2, ctas_per_sm=1, plan="xla", warpgroups=4)))
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 2
    with pytest.raises(ValueError, match="down_config must tile rows"):
        mm.MgpuConfig(rows=40, down_config=mm.MgpuConfig(rows=16))
    # K3's expert shapes (3584 -> 3072 -> 3584, 112 experts per device at EP 8): every default's stages fit shared
    # memory at the K loops these widths give (the warp-specialised kernel checks that while lowering)
    E = 112
    for rows in (8, 32, 64, 146):
        text = _tiled_ffn_cuda_text(mm.tiled_config(rows, (3072, 3584)), E=E, D=3584, F=3072, M=E * rows)
        assert text.count("stablehlo.custom_call @mosaic_gpu") in (2, 3), rows


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [dict(), dict(kh=256, steps=2), dict(rows=32, ctas_per_sm=4, steps=3),
                                 dict(rows=64, ctas_per_sm=1, steps=3), dict(kh=64, ctas_per_sm=3, steps=3),
                                 dict(mma="fp8", rows=8), dict(mma="fp8", rows=16, kh=64), dict(mma="fp8", rows=32),
                                 dict(rows=8, plan="xla"), dict(rows=32, kh=256, steps=2, plan="xla"),
                                 dict(mma="fp8", rows=16),
                                 dict(rows=8, plan="kernel"), dict(rows=32, kh=256, steps=2, plan="kernel"),
                                 dict(rows=16, ctas_per_sm=4, plan="kernel"), dict(rows=48, kh=256, steps=2, plan="xla")])
@pytest.mark.parametrize("layout", ["placed", "natural"])
def test_gpu_mgpu_mxfp4_matches_reference(cfg, layout):
    """The Mosaic GPU MXFP4 kernel on the device against ragged_dot over the exactly dequantised weights: groups of
    8, 0, 70, 3, 8, 16, 1 and 30 rows (starting off the 8-row grid) and uncovered tail rows, which come back as
    zeros; both code layouts (the fp8 path decodes natural codes only), both group plans (in the kernel, the
    default; padded in XLA)."""
    from pallas_kernels.moe import mgpu_mxfp4 as mm

    if cfg.get("mma") == "fp8" and layout == "placed":
        pytest.skip("the fp8 path takes natural codes (a ValueError, tested on the CPU)")
    sizes, x, w, gs, want = _device_mxfp4_case()
    got = mm.grouped_matmul(x, mm.prepare_weight(w, layout), gs, config=mm.MgpuConfig(**cfg))
    assert _rel(got, want) < (3e-3 if cfg.get("mma") == "fp8" else 1e-4)  # fp8: x as two e4m3 planes
    assert not np.asarray(got[sum(sizes):]).any()


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [8, 32])
def test_gpu_mgpu_mxfp4_in_kernel_plan_edges(rows):
    """The in-kernel group plan at its edges: fewer rows than one x tile (M = 5), more rows routed than given
    (Σ sizes > M: clipped), and a group that fills whole tiles from an 8-aligned start next to ones that do not."""
    from pallas_kernels.moe import mgpu_mxfp4 as mm

    E, K, N = 4, 512, 128
    w = mx.random_weight(jax.random.key(21), E, K, N)
    wd = mx.dequantize(w, jnp.bfloat16)
    cfg = mm.MgpuConfig(rows=rows, kh=128, steps=2, plan="kernel")
    for M, sizes in ((5, [2, 0, 1, 1]), (40, [16, 24, 0, 0]), (40, [16, 5, 30, 9]), (64, [3, 40, 1, 7])):
        x = jax.random.normal(jax.random.key(M + sizes[1]), (M, K), jnp.bfloat16)
        gs = jnp.asarray(sizes, jnp.int32)
        clipped = jnp.asarray(np.diff(np.minimum(np.cumsum([0] + sizes), M)), jnp.int32)
        want = reference.grouped_matmul(x, wd, clipped)
        got = mm.grouped_matmul(x, mm.prepare_weight(w), gs, config=cfg)
        assert got.shape == (M, N)
        assert _rel(got, want) < 1e-4, (M, sizes)
        assert not np.asarray(got[int(clipped.sum()):]).any()


@pytest.mark.gpu
def test_gpu_ops_run_prepared_weights_on_the_mosaic_kernel():
    """On the GPU, `ops` runs a prepared weight through the Mosaic MXFP4 kernel (a grouped matmul and the expert FFN
    with all three weights prepared), against the reference over the exactly dequantised weights."""
    from pallas_kernels.moe import mgpu_mxfp4 as mm

    sizes, x, w, gs, want = _device_mxfp4_case()
    got = jax.jit(lambda a, b, g: ops.grouped_matmul(a, b, g, backend="gpu"))(x, mm.prepare_weight(w), gs)
    assert _rel(got, want) < 1e-4
    assert not np.asarray(got[sum(sizes):]).any()
    # an FFN wide enough for the kernel's tiles (D = 512, F = 256: 128-byte steps for the down projection)
    N, D, F, E, k = 40, 512, 256, 4, 2
    rng = np.random.default_rng(3)
    xf = jnp.asarray(rng.standard_normal((N, D)), jnp.bfloat16)
    idx = jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(N)]), jnp.int32)
    wt = jnp.asarray(rng.random((N, k)), jnp.float32)
    keys = jax.random.split(jax.random.key(3), 3)
    ws = [mx.random_weight(keys[0], E, D, F), mx.random_weight(keys[1], E, D, F), mx.random_weight(keys[2], E, F, D)]
    assert all(ops._mosaic_takes(N * k // E, mm.prepare_weight(q), None) for q in ws)
    ref = reference.expert_ffn(xf, idx, wt, *[mx.dequantize(q, jnp.bfloat16) for q in ws], situ)
    prepared = [mm.prepare_weight(q) for q in ws]
    out = jax.jit(lambda *a: ops.expert_ffn(*a, situ, backend="gpu"))(xf, idx, wt, *prepared)
    assert _rel(out, ref) < 2e-2
    # planned from the pairs (`slot_tile_plan`) = planned from the sorted rows (the earlier path), bit for bit
    _, tok, gs, slot_row = ops.dispatch_plan(idx, E)
    sorted_plan = jax.jit(lambda a, t, g, r, w_, *w: ops.combine_slots(
        mm.expert_ffn_tiled(a, g, *w, situ, token_of_row=t, out_rows=r), w_))(xf, tok, gs, slot_row, wt, *prepared)
    assert np.array_equal(np.asarray(out), np.asarray(sorted_plan))


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [dict(rows=16, kh=128, steps=4), dict(rows=16, kh=256, steps=2),
                                 dict(rows=48, kh=128, steps=3), dict(rows=80, kh=128, steps=4),
                                 dict(rows=40, kh=64, steps=4, warpgroups=4)])
def test_gpu_mgpu_mxfp4_warp_specialised_matches_reference(cfg):
    """The warp-specialised kernel (`MgpuConfig(warpgroups=2)`) on the device against ragged_dot over the exactly
    dequantised weights, in both of its pipeline forms: the shared case's groups (fewer work items than CTAs: each
    CTA's item a pipeline of its own), then 2000 rows over 8 experts with 1024 output columns (hundreds of items:
    each CTA's items one chain of pipelines, START / STEADY / STOP)."""
    from pallas_kernels.moe import mgpu_mxfp4 as mm

    config = mm.MgpuConfig(**{"warpgroups": 2, **cfg}, ctas_per_sm=1, plan="xla")
    sizes, x, w, gs, want = _device_mxfp4_case()
    for layout in ("placed", "natural"):
        got = mm.grouped_matmul(x, mm.prepare_weight(w, layout), gs, config=config)
        assert _rel(got, want) < 1e-4, layout
        assert not np.asarray(got[sum(sizes):]).any()
    sizes = [300, 0, 17, 650, 1, 432, 250, 350]
    E, K, N = len(sizes), 1024, 1024
    x = jax.random.normal(jax.random.key(21), (sum(sizes), K), jnp.bfloat16)
    w = mx.random_weight(jax.random.key(22), E, K, N)
    gs = jnp.asarray(sizes, jnp.int32)
    want = jax.jit(reference.grouped_matmul)(x, mx.dequantize(w, jnp.bfloat16), gs)
    got = mm.grouped_matmul(x, mm.prepare_weight(w), gs, config=config)
    assert _rel(got, want) < 1e-4


def _device_ffn_case(F: int, seed: int):
    """An expert FFN case for the device tests: E = 4 experts, D = 512, width F; skewed groups (one empty, one of
    70 rows) and 5 uncovered tail rows -> (sizes, (gate, up, down) MXFP4 weights, x bf16, group sizes)."""
    E, D = 4, 512
    sizes = [3, 0, 70, 9]
    keys = jax.random.split(jax.random.key(seed), 4)
    ws = [mx.random_weight(keys[0], E, D, F), mx.random_weight(keys[1], E, D, F), mx.random_weight(keys[2], E, F, D)]
    x = jax.random.normal(keys[3], (sum(sizes) + 5, D), jnp.bfloat16)
    return sizes, ws, x, jnp.asarray(sizes, jnp.int32)


@pytest.mark.gpu
def test_gpu_three_compute_warpgroups_match_reference():
    """W = 3 compute warpgroups (192-column items, 152 registers each): one matmul (whole items, and a ragged last
    item), and the tile-layout FFN with gate, up and SiTU fused at W = 3 (F = 384: two items) and down on a W = 2
    or W = 3 (ragged) config of its own, gate / up in either column order, against the references."""
    from pallas_kernels.moe import mgpu_mxfp4 as mm

    sizes, ws, x, gs = _device_ffn_case(F=384, seed=33)
    w3 = mm.MgpuConfig(rows=40, kh=64, steps=4, ctas_per_sm=1, plan="xla", warpgroups=3)
    want = jax.jit(reference.grouped_matmul)(x, mx.dequantize(ws[0], jnp.bfloat16), gs)
    got = mm.grouped_matmul(x, mm.prepare_weight(ws[0]), gs, config=w3)
    assert _rel(got, want) < 1e-4
    # down's 512 columns on W = 3: two whole 192-column items and a ragged third of 128 (its last 64 columns read
    # as zeros past the weight, not stored)
    h = jax.random.normal(jax.random.key(34), (x.shape[0], 384), jnp.bfloat16)
    want = jax.jit(reference.grouped_matmul)(h, mx.dequantize(ws[2], jnp.bfloat16), gs)
    got = mm.grouped_matmul(h, mm.prepare_weight(ws[2]), gs, config=w3)
    assert _rel(got, want) < 1e-4 and got.shape == want.shape
    want = ops.expert_ffn_sorted(x, gs, *ws, situ, backend="reference")
    down = mm.MgpuConfig(rows=40, kh=128, steps=4, ctas_per_sm=1, plan="xla", warpgroups=2)
    for kh, down in ((64, down), (128, down), (128, dataclasses.replace(down, warpgroups=3))):
        cfg = dataclasses.replace(w3, kh=kh, gate_up="fused", down_config=down)
        for prepared in ([mm.prepare_weight(q) for q in ws], mm.prepare_ffn_weights(*ws)):
            got = jax.jit(lambda a, g, *w, cfg=cfg: mm.expert_ffn_tiled(a, g, *w, situ, config=cfg))(x, gs, *prepared)
            assert _rel(got, want) < 1e-2, (kh, down.warpgroups, prepared[0].out_order)
            assert not np.asarray(got[sum(sizes):]).any()


@pytest.mark.gpu
def test_gpu_tiled_expert_ffn_matches_reference_and_the_per_matmul_path():
    """The tile-layout FFN on the device (three Mosaic kernels on padded rows; or gate, up and SiTU fused into one
    warp-specialised kernel) against the reference FFN over the exactly dequantised weights, and against the same
    FFN with each matmul padded and unpadded on its own; skewed groups (one empty, one of 70 rows) and uncovered
    tail rows."""
    from pallas_kernels.moe import mgpu_mxfp4 as mm

    sizes, ws, x, gs = _device_ffn_case(F=256, seed=31)
    want = ops.expert_ffn_sorted(x, gs, *ws, situ, backend="reference")
    prepared = [mm.prepare_weight(q) for q in ws]
    rows48 = dataclasses.replace(mm.tiled_config(32, (192,)), rows=48)  # one warpgroup per CTA
    # tiled_config(32 / 64): the warp-specialised kernel (two compute warpgroups), gate, up and SiTU fused; beside
    # them its three separate matmuls, and 40- and 80-row tiles on one warpgroup per CTA
    ws_separate = dataclasses.replace(mm.tiled_config(64), gate_up="separate")
    rows40, rows80 = mm.tiled_config(32, (192,)), mm.tiled_config(64, (192,))  # widths that take one warpgroup
    # tiles that are not powers of two: 40 rows, 48, 80
    # down on four compute warpgroups of its own after the fused two-warpgroup gate / up
    down_w4 = dataclasses.replace(mm.tiled_config(32), down_config=mm.MgpuConfig(
        rows=40, kh=64, steps=2, ctas_per_sm=1, plan="xla", warpgroups=4))
    for cfg, gate_up_dtype in ((mm.tiled_config(8), None), (mm.tiled_config(32), None), (rows48, None),
                               (mm.tiled_config(64), None), (ws_separate, None), (rows40, None), (rows80, None),
                               (down_w4, None), (None, jnp.bfloat16), (None, None)):
        kw = {} if gate_up_dtype is None else dict(gate_up_dtype=gate_up_dtype)  # default: fp32 gate / up
        got = jax.jit(lambda a, g, *w, cfg=cfg, kw=kw: mm.expert_ffn_tiled(a, g, *w, situ, config=cfg, **kw))(
            x, gs, *prepared)
        assert _rel(got, want) < 1e-2, (cfg, kw)
        assert not np.asarray(got[sum(sizes):]).any()
    per_matmul = [mm.grouped_matmul(x, w, gs) for w in prepared[:2]]
    h = situ(*per_matmul).astype(jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(got), np.asarray(mm.grouped_matmul(h, prepared[2], gs)), rtol=2e-2,
                               atol=2e-2 * float(jnp.abs(want).max()))
    # gate / up in the down matmul's plane order (what a model on a GPU prepares): h handed over as planes, written
    # so by the fused kernel or moved in 64-column blocks after separate ones
    ffn_prepared = mm.prepare_ffn_weights(*ws)
    assert [q.out_order for q in ffn_prepared] == ["planes", "planes", "natural"]
    for cfg in (mm.tiled_config(8), mm.tiled_config(32), rows48, mm.tiled_config(64), ws_separate, rows40, None):
        got = jax.jit(lambda a, g, *w, cfg=cfg: mm.expert_ffn_tiled(a, g, *w, situ, config=cfg))(x, gs, *ffn_prepared)
        assert _rel(got, want) < 1e-2, cfg
        assert not np.asarray(got[sum(sizes):]).any()
    # one matmul with a plane-order weight gives its natural columns back, bit for bit
    np.testing.assert_array_equal(np.asarray(mm.grouped_matmul(x, ffn_prepared[0], gs)), np.asarray(per_matmul[0]))
    # and `ops` takes this path for three prepared weights on the GPU
    assert ops._tiled_ffn_takes(x.shape[0], prepared, "gpu", False, None)
    got = jax.jit(lambda a, g, *w: ops.expert_ffn_sorted(a, g, *w, situ, backend="gpu"))(x, gs, *prepared)
    assert _rel(got, want) < 1e-2


@pytest.mark.gpu
def test_gpu_model_runs_its_mxfp4_experts_on_the_mosaic_kernel(tmp_path):
    """On a GPU host a loaded model with MXFP4 experts (K3.1's expert layout at latent and intermediate widths of
    128) re-lays them for the Mosaic kernel when its MoE backend is the GPU one, and its logits equal the reference
    path's (which keeps the checkpoint's layout)."""
    from convert.synthetic import write_k3_checkpoint
    from kimi_jax import checkpoint
    from kimi_jax.config import get_preset
    from kimi_jax.kernels import KernelConfig
    from kimi_jax.model import _flat

    cfg = get_preset("tiny")
    cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, latent_size=128, intermediate_size=128))
    write_k3_checkpoint(str(tmp_path), cfg, seed=1, dtype="F32", shard_bytes=400_000)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 9))
    ref = checkpoint.load(str(tmp_path), kernels=KernelConfig.reference())  # the Hugging Face directory itself
    assert not any(k.endswith(".codes") for k in _flat(ref.params))
    want = ref.logits(ids)
    model = checkpoint.load(str(tmp_path), kernels=KernelConfig(moe="gpu"))
    flat = _flat(model.params)
    assert any(k.endswith("experts.gate.codes") for k in flat) and not any(k.endswith(".packed") for k in flat)
    np.testing.assert_allclose(model.logits(ids), want, rtol=0, atol=2e-2 * float(np.abs(want).max()))


@pytest.mark.gpu
def test_gpu_mgpu_mxfp4_placed_with_large_and_zero_scales():
    """The placed decode on the device at the edges of its multiplier: one expert's scale codes above 128 (lowered
    per expert, restored in fp32 — in the tile layout's kernels, on the accumulators), codes 1 and 0 (a zero scale)
    in another; every group's rows against ragged_dot over the exactly dequantised weights on their own."""
    from pallas_kernels.moe import mgpu_mxfp4 as mm

    sizes, x, w, gs, _ = _device_mxfp4_case()
    scale = np.asarray(w.scale).copy()
    scale[2] += 70  # the 70-row group: codes 188..196
    scale[4, :, ::3] = 1
    scale[4, :, 1::3] = 0
    w = mx.MXFP4Weight(w.packed, jnp.asarray(scale))
    want = jax.jit(reference.grouped_matmul)(x, mx.dequantize(w, jnp.bfloat16), gs)
    prepared = mm.prepare_weight(w)
    got = mm.grouped_matmul(x, prepared, gs)
    # the tile layout's matmul applies the expert factor inside the kernel: one warpgroup per CTA, warp-specialised
    tiled = {}
    for cfg in (mm.MgpuConfig(rows=16, kh=256, steps=2, ctas_per_sm=3), mm.tiled_config(32)):
        plan = mm.tile_plan(gs, x.shape[0], len(sizes), cfg.rows)
        y_pad = jax.jit(lambda a, p, w_, cfg=cfg: mm.tiled_matmul(a[p.src], p, w_, cfg))(
            jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)]), plan, prepared)
        tiled[cfg.warpgroups] = y_pad[plan.pad_row]
    ends = np.cumsum(sizes)
    for g, (a, b) in enumerate(zip(ends - np.asarray(sizes), ends)):
        if b > a:
            assert _rel(got[a:b], want[a:b]) < 1e-4, g
            for wgs, y in tiled.items():
                assert _rel(y[a:b], want[a:b]) < 1e-4, (g, wgs)


def test_moe_layer_relays_mxfp4_experts_for_the_mosaic_kernel_exactly():
    """`prepare_experts` (what the loader does once, for a GPU platform): a layer's `MXFP4Experts` become the Mosaic
    kernel's layout (`MosaicMXFP4Experts`: placed codes, transposed scales, exponent offsets), split by expert like
    the checkpoint's; the layer's output is bit-for-bit the same (off the GPU the ops turn the layout back exactly).
    Only layers whose kernel backend is the GPU one are re-laid; shapes the kernel does not take stay as they are."""
    from flax import nnx

    from kimi_jax.config import MoEConfig
    from kimi_jax.kernels import KernelConfig
    from kimi_jax.model import _flat
    from kimi_jax.modules.moe import MoE, prepare_experts
    from pallas_kernels.moe.experts import MosaicMXFP4Experts, MXFP4Experts
    from sharding.rules import param_partition_spec

    def layer(latent=128, F=128):
        cfg = MoEConfig(num_experts=4, top_k=2, intermediate_size=F, latent_size=latent)
        m = MoE(96, cfg, situ, 1e-6, rngs=nnx.Rngs(0))
        keys = iter(jax.random.split(jax.random.key(5), 3))
        m.set_experts(MXFP4Experts(*(mx.random_weight(next(keys), 4, k, n)
                                     for k, n in ((latent, F), (latent, F), (F, latent)))))
        return m

    x = jax.random.normal(jax.random.key(6), (2, 5, 96), jnp.float32)
    m = layer()
    want = np.asarray(m(x))
    checkpoint_arrays = m.expert_weights()
    # its kernels are not the GPU ones, or the platform has none: nothing is re-laid
    assert prepare_experts(m, KernelConfig(moe="reference"), "gpu") == 0
    assert prepare_experts(m, KernelConfig(moe="auto"), "cpu") == 0
    assert prepare_experts(m, KernelConfig(moe="gpu", moe_interpret=True), "gpu") == 0
    assert isinstance(m.expert_weights(), MXFP4Experts)
    with mock.patch.object(gpu_triton, "available", lambda: False):  # "auto" on a GPU without jax-triton
        assert prepare_experts(m, KernelConfig(moe="auto"), "gpu") == 0
    with mock.patch.object(gpu_triton, "available", lambda: True):  # ... and with it
        assert prepare_experts(m, KernelConfig(moe="auto"), "gpu") == 1
    assert isinstance(m.expert_weights(), MosaicMXFP4Experts)
    for got, orig in zip(jax.tree.leaves(m.expert_weights().to_mxfp4()), jax.tree.leaves(checkpoint_arrays)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(orig))  # the same values, exactly
    assert prepare_experts(m, KernelConfig(moe="gpu"), "gpu") == 0  # once
    flat = _flat(nnx.state(m, nnx.Param))
    assert not any(k.endswith(".packed") for k in flat)
    assert (flat["experts.gate.codes"].shape, flat["experts.gate.scales_t"].shape,
            flat["experts.gate.out_scale"].shape) == ((4, 128, 64), (4, 4, 128), (4,))
    np.testing.assert_array_equal(np.asarray(m(x)), want)
    for name in ("gate.codes", "down.scales_t", "up.out_scale"):
        shape = flat["experts." + name].shape
        assert param_partition_spec(f"layers.3.block_sparse_moe.experts.{name}", shape, 2)[0] == "model"
    assert prepare_experts(layer(latent=64), KernelConfig(moe="gpu"), "gpu") == 0  # K = 64: not a multiple of 128
