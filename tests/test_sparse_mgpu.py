"""The Mosaic GPU sparse MLA decode kernel (`pallas_kernels.mla.sparse_mgpu`): its XLA side and contract on CPU (the
kernel's maths in jnp, the operand orders, lowering for CUDA at K3.1 shapes) and the kernel itself against the
reference on the dequantised rows on a GPU (`gpu` marker)."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimi_jax import quant as Q
from pallas_kernels import triton_call
from pallas_kernels.mla import sparse
from pallas_kernels.mla.reference import merge_partials
from pallas_kernels.mla.sparse_gpu_triton import pool_rows
from pallas_kernels.mla import sparse_mgpu as sm
from pallas_kernels.moe.mgpu_mxfp4 import x_permutation

# bench/mla_trace.py (the kernel's timer stamps read back), loaded by path: bench/ on sys.path would shadow the
# `convert` package with bench/convert.py for every later import in this process
_trace_spec = importlib.util.spec_from_file_location("mla_trace", Path(__file__).resolve().parents[1] / "bench" /
                                                     "mla_trace.py")
mla_trace = importlib.util.module_from_spec(_trace_spec)
_trace_spec.loader.exec_module(mla_trace)

R, ROPE = 512, 64  # K3.1 latent geometry: the kernel reads K3 widths only
C = R + ROPE
SCALE = 192 ** -0.5


def rel_rms(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    ok = np.isfinite(b)
    assert (np.isfinite(a) == ok).all()
    return float(np.sqrt(np.mean((a[ok] - b[ok]) ** 2)) / max(np.sqrt(np.mean(b[ok] ** 2)), 1e-30))


def case(seed=0, B=3, H=12, k=300, page=64, nb=64, max_blocks=40):
    """fp8 pool `[nb, page, 576]` (layer scale 0.5), block tables, top-k positions with empty slots, q."""
    rng = np.random.default_rng(seed)
    fmt = Q.LatentFormat("fp8", R, ROPE)
    (pool,) = fmt.quantize(jnp.asarray(rng.standard_normal((nb, page, C)), jnp.float32), 0.5)
    bt = np.stack([rng.permutation(nb)[:max_blocks] for _ in range(B)]).astype(np.int32)
    ctx = page * max_blocks
    idx = np.stack([rng.permutation(ctx)[:k] for _ in range(B)]).astype(np.int32)
    idx[0, 7] = -1  # an empty slot inside a block
    q = rng.standard_normal((B, H, C)).astype(np.float32)
    kw = dict(fmt=fmt, layer_scale=jnp.float32(0.5), scale=SCALE, value_dim=R)
    return (pool,), bt, idx, q, kw


def emulate_kernel(q16, c2, slots, block_tables, pool_u8, *, R: int, page: int, value_mma: str = "f16"):
    """`sm.kernel_call`'s contract in jnp (float32): positions -> pool rows by the block table (`pool_rows`), then for
    each (sequence, split) the softmax in log2 units over the split's gathered rows (empty slots masked), o
    normalised, `[NS, B, 16, R]` in natural dim order. q16: f16 in `x_permutation` order, or (logits_mma="fp8") the
    (hi, lo) e4m3 planes in `fp8_q_permutation` order. value_mma="fp8": the PV product sees P · 2^8 as e4m3 hi + lo
    (the row sums stay f32)."""
    B, NS, n_blk, keys = slots.shape
    if isinstance(q16, tuple):  # the fp8 planes: the tensor cores add both products in f32
        q16, perm = q16[0].astype(jnp.float32) + q16[1].astype(jnp.float32), sm.fp8_q_permutation(q16[0].shape[-1])
    else:
        perm = x_permutation(q16.shape[-1])
    c = q16.shape[-1]
    rows_id = pool_rows(block_tables, slots.reshape(B, -1), page, pool_u8.shape[0] // page)
    rows = jax.lax.bitcast_convert_type(pool_u8[jnp.maximum(rows_id, 0)], jnp.float8_e4m3fn).astype(jnp.float32)
    rows = rows.reshape(B, NS, n_blk * keys, c)
    valid = rows_id.reshape(B, NS, n_blk * keys) >= 0
    logical = rows[..., jnp.asarray(perm)]  # the A operand's column order, which q16 is stored in
    s = jnp.einsum("bskc,bhc->bshk", logical, q16.astype(jnp.float32)) * c2[:, None, :, None]
    s = jnp.where(valid[:, :, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp2(s - m)
    l = jnp.sum(p, axis=-1)
    if value_mma == "fp8":
        ps = p * sm.P_SCALE
        hi = ps.astype(jnp.float8_e4m3fn).astype(jnp.float32)
        p = (hi + (ps - hi).astype(jnp.float8_e4m3fn).astype(jnp.float32)) / sm.P_SCALE
    o = jnp.einsum("bshk,bskr->bshr", p, rows[..., :R]) / jnp.where(l > 0, l, 1.0)[..., None]
    lse = jnp.where(l > 0, (m[..., 0] + jnp.log2(jnp.where(l > 0, l, 1.0))) * np.log(2.0), -jnp.inf)
    return jnp.moveaxis(o, 1, 0), jnp.moveaxis(lse, 1, 0)


def test_value_rows_and_q_columns_are_permutations():
    for r in (128, 256, 512):
        assert sorted(sm.value_dim_of_row(r)) == list(range(r))
    # thread (w, g) of the PV operand owns 16 contiguous dims at R = 512: rows g, g + 8 of each of the 8 tiles
    dims = sm.value_dim_of_row(512)
    owned = sorted(dims[64 * i + 16 * 1 + 8 * h + 3] for i in range(8) for h in (0, 1))  # w = 1, g = 3
    assert owned == list(range(16 * (8 + 3), 16 * (8 + 3) + 16))
    assert sorted(x_permutation(C)) == list(range(C))
    assert sorted(sm.KAPPA) == list(range(8))


def test_gathered_row_loads_are_free_of_bank_conflicts():
    """Every 8-thread phase of every 16-byte shared-memory load of both operands touches 8 distinct bank groups with
    the row stride c + 32 and the KAPPA key order (the plain order gave the PV loads 4 per phase on the H200)."""
    stride = sm.row_stride(C)
    key = lambda pos: 8 * (pos // 8) + sm.KAPPA[pos % 8]  # noqa: E731

    def phases_ok(addr_of):
        for p in range(4):
            lanes = [(g, t) for g in (2 * p, 2 * p + 1) for t in range(4)]
            if len({(addr_of(g, t) // 16) % 8 for g, t in lanes}) != 8:
                return False
        return True

    for w in range(4):
        for h in (0, 1):  # logits operand: thread (g, t) loads key row 16w + 8h + g at byte 64j + 16t
            assert all(phases_ok(lambda g, t: key(16 * w + 8 * h + g) * stride + 64 * j + 16 * t) for j in range(9))
        for pos0 in (0, 8):  # PV operand: keys at K positions pos0 + 2t (+1), the thread's 16 dims at 16(8w + g)
            for e in (0, 1):
                assert phases_ok(lambda g, t: key(pos0 + 2 * t + e) * stride + 16 * (8 * w + g))


def test_in_kernel_q_columns_invert_the_contraction_order():
    """`_prep_q_fn`'s lane l writes q's column 32i + l to `q_column_of(i, l)`: exactly where `prepare_q` puts it."""
    inverse = np.argsort(x_permutation(C))
    lanes = np.arange(32)
    for i in range(C // 32):
        assert (sm.q_column_of(i, lanes) == inverse[32 * i + lanes]).all()


def test_fp8_q_order_is_the_wgmma_8bit_fragment_of_each_16_byte_load():
    """fp8 logits: thread t's word s of the 64-column chunk j (stored bytes 64j + 16t + 4s .. + 3) is the WGMMA_8BIT
    register of 32-column group 2j + s // 2, block s % 2: logical columns 32·(2j + s // 2) + 16·(s % 2) + 4t .. + 3."""
    perm = sm.fp8_q_permutation(C)
    assert sorted(perm) == list(range(C))
    for j in range(C // 64):
        for t in range(4):
            for s in range(4):
                logical = 32 * (2 * j + s // 2) + 16 * (s % 2) + 4 * t + np.arange(4)
                assert (perm[logical] == 64 * j + 16 * t + 4 * s + np.arange(4)).all()


def test_prepare_q_fp8_keeps_every_logit_to_bf16_precision():
    """q as two e4m3 planes (hi + lo, about 8 significant bits) in the fp8 order, dotted with the stored rows in that
    order and scaled by c2 = the plain logits · log2 e, to bf16-like precision."""
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 12, C)).astype(np.float32)
    rows = np.asarray(jnp.asarray(rng.standard_normal((5, C)), jnp.float8_e4m3fn).astype(jnp.float32))
    hi, lo, c2 = sm.prepare_q_fp8(jnp.asarray(q), 0.3)
    assert hi.dtype == lo.dtype == jnp.float8_e4m3fn and hi.shape == (2, sm.HEADS, C) and c2.shape == (2, sm.HEADS)
    assert float(jnp.max(jnp.abs(hi[:, 12:].astype(jnp.float32)))) == 0.0
    qf = hi.astype(jnp.float32) + lo.astype(jnp.float32)
    got = jnp.einsum("kc,bhc->bhk", rows[:, sm.fp8_q_permutation(C)], qf) * c2[..., None]
    want = np.einsum("kc,bhc->bhk", rows, q * 0.3) * np.log2(np.e)
    assert rel_rms(got[:, :12], want) <= 4e-3


def test_fp8_value_transpose_ptx_moves_every_byte():
    """fp8 PV: `_TRANSPOSE4` (modelled instruction by instruction) turns 4 keys' words (byte j = dim j) into 4 words
    of one dim each (byte e = key e): the WGMMA_8BIT A register of 4 consecutive contraction positions."""
    from test_moe_kernels import _run_ptx

    rng = np.random.default_rng(0)
    for _ in range(20):
        keys = rng.integers(0, 256, (4, 4))  # [key, dim]
        regs = _run_ptx(sm._TRANSPOSE4, {f"${4 + e}": int(sum(int(keys[e, j]) << 8 * j for j in range(4)))
                                         for e in range(4)})
        for dim in range(4):
            assert [(regs[f"${dim}"] >> 8 * e) & 255 for e in range(4)] == list(keys[:, dim])


def test_fp8_value_positions_spread_each_load_phase_over_8_bank_groups():
    """fp8 PV: position p holds key `pv_key_of(p)` (an involution inside each 16); the 8 lanes (g, q) of a 16-byte
    load phase read key pv_key_of(base + 4q + e) at dim byte 16(8w + g) of rows `row_stride` apart: 8 distinct
    bank groups (16-byte units mod 8) for every base, e and w."""
    stride = sm.row_stride(C)
    assert [sm.pv_key_of(sm.pv_key_of(p)) for p in range(64)] == list(range(64))
    for base in (0, 16, 32, 48):
        for e in range(4):
            for w in range(4):
                groups = {((sm.pv_key_of(base + 4 * q + e) * stride) // 16 + 8 * w + g) % 8
                          for g in (0, 1) for q in range(4)}
                assert len(groups) == 8


def test_prepare_q_keeps_every_logit():
    """q in the kernel's column order dotted with the rows in that order = the plain logits (times log2 e), up to f16."""
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 12, C)).astype(np.float32)
    rows = rng.standard_normal((5, C)).astype(np.float32)
    q16, c2 = sm.prepare_q(jnp.asarray(q), 0.3)
    assert q16.shape == (2, sm.HEADS, C) and q16.dtype == jnp.float16 and c2.shape == (2, sm.HEADS)
    assert float(jnp.max(jnp.abs(q16[:, 12:]))) == 0.0
    got = jnp.einsum("kc,bhc->bhk", rows[:, x_permutation(C)], q16.astype(jnp.float32)) * c2[..., None]
    want = np.einsum("kc,bhc->bhk", rows, q * 0.3) * np.log2(np.e)
    assert rel_rms(got[:, :12], want) <= 1e-3


@pytest.mark.parametrize("splits,warpgroups,merge,prep,mma", [
    (1, 1, "kernel", "xla", "f16"), (4, 1, "kernel", "xla", "f16"), (2, 4, "kernel", "xla", "f16"),
    (4, 2, "last", "xla", "f16"), (4, 2, "last", "kernel", "f16"), (8, 1, "kernel", "kernel", "f16"),
    (4, 2, "kernel", "xla", "fp8"), (2, 1, "last", "xla", "fp8"), (4, 2, "kernel", "xla", "fp8-fp8")])
def test_contract_with_xla_side_matches_reference(splits, warpgroups, merge, prep, mma, monkeypatch):
    """decode's XLA side (q, slots, merge, row order) around the kernel's contract (`emulate_kernel`) = the reference
    at the storage bar, with empty slots, a split that is all padding and a sequence with no key. With merge="last"
    the kernel returns the merged heads · layer scale itself (`reference.merge_partials`' maths)."""
    parts, bt, idx, q, kw = case(seed=2)
    idx[2] = -1

    def fake_kernel(q, c2, slots, bt, pool, *, R, page, config, H, layer_scale, scale):
        assert slots.shape[2] % config.warpgroups == 0  # each warpgroup gets the same number of blocks
        if config.prep == "kernel":  # the raw q: the kernel prepares it as `prepare_q` does
            assert c2 is None and q.shape[1] == H
            q, c2 = sm.prepare_q(q, scale * layer_scale)
        o, lse = emulate_kernel(q, c2, slots, bt, pool, R=R, page=page, value_mma=config.value_mma)
        if config.merge == "kernel":
            return o, lse
        o, lse = merge_partials(o[:, :, :H], lse[:, :, :H])
        return o * layer_scale, lse

    monkeypatch.setattr(sm.kernel, "kernel_call", fake_kernel)
    real_merge = sm.merge  # the Triton merge kernel, in Triton's interpreter on CPU
    monkeypatch.setattr(sm.kernel, "merge", lambda o, lse, H, ls: real_merge(o, lse, H, ls, interpret=True))
    o_r, lse_r = sparse.decode(q, parts, bt, idx, backend="reference", **kw)
    mma, value_mma = mma.split("-") if "-" in mma else (mma, "f16")  # "fp8-fp8": both products on e4m3
    cfg = sm.MgpuSparseConfig(splits=splits, warpgroups=warpgroups, merge=merge, prep=prep, logits_mma=mma,
                              value_mma=value_mma)
    o, lse = sm.decode(q, parts, bt, idx, config=cfg, **kw)
    o, lse = np.asarray(o), np.asarray(lse)
    assert o.shape == (3, 12, R) and lse.shape == (3, 12)
    assert (o[2] == 0).all() and (lse[2] == -np.inf).all()
    assert rel_rms(o[:2], np.asarray(o_r)[:2]) <= 5e-3 and rel_rms(lse[:2], np.asarray(lse_r)[:2]) <= 5e-3


def test_sparse_mla_routes_impl_mgpu_and_refuses_interpret_mode():
    """`kernel_kw={"impl": "mgpu"}` picks this kernel on the GPU backend; it has no interpret mode (CPU) and says so."""
    parts, bt, idx, q, kw = case(seed=5)
    with pytest.raises(ValueError, match="no interpret mode"):
        sparse.decode(q, parts, bt, idx, backend="gpu_interpret", kernel_kw={"impl": "mgpu"}, **kw)
    with pytest.raises(TypeError):  # a key that is not an MgpuSparseConfig field
        sparse.decode(q, parts, bt, idx, backend="gpu", kernel_kw={"impl": "mgpu", "block_h": 16}, **kw)


ONE_WG = dict(splits=8, warpgroups=1)  # one warpgroup per CTA: the earlier default
ONE_WG_CFG = sm.MgpuSparseConfig(**ONE_WG)


def test_supports_only_fp8_rows_at_kernel_widths():
    assert sm.supports(Q.LatentFormat("fp8", 512, 64))
    assert not sm.supports(Q.LatentFormat("nvfp4", 512, 64))
    assert not sm.supports(Q.LatentFormat("fp8", 64, 16))  # the tiny preset's widths
    assert sm.supports(Q.LatentFormat("fp8", 128, 64)) and sm.supports(Q.LatentFormat("fp8", 128, 64), ONE_WG_CFG)
    assert not sm.supports(Q.LatentFormat("fp8", 128, 64), sm.MgpuSparseConfig())  # merge="last": 256 threads ∤ 128
    with pytest.raises(ValueError, match="fp8 rows"):
        sm.decode(np.zeros((1, 4, 80), np.float32), (jnp.zeros((2, 64, 80), jnp.float8_e4m3fn),),
                  np.zeros((1, 2), np.int32), np.zeros((1, 64), np.int32), fmt=Q.LatentFormat("fp8", 64, 16),
                  scale=1.0, value_dim=64)


# four warpgroups of one stage, each waiting for its wgmmas chunk by chunk (128 registers a thread at 512 threads)
WG4_CHUNK_WAIT = dict(splits=4, stages=1, warpgroups=4, logits_chunk=64, value_keys=16, mma_wait="chunk")
TWO_LAUNCHES = dict(prep="xla", merge="kernel")  # q prepared in XLA, the splits merged by a second kernel


@pytest.mark.parametrize("cfg", [sm.MgpuSparseConfig(), sm.MgpuSparseConfig(**ONE_WG),
                                 sm.MgpuSparseConfig(**ONE_WG, stages=3, logits_chunk=64, value_keys=64, logits_accs=3),
                                 sm.MgpuSparseConfig(splits=4, stages=1, warpgroups=4, logits_chunk=64, value_keys=16),
                                 sm.MgpuSparseConfig(**TWO_LAUNCHES),
                                 sm.MgpuSparseConfig(**ONE_WG, **TWO_LAUNCHES),
                                 sm.MgpuSparseConfig(merge="last", prep="xla"),
                                 sm.MgpuSparseConfig(**ONE_WG, prep="kernel", merge="kernel"),
                                 sm.MgpuSparseConfig(splits=4, stages=1, warpgroups=4, logits_chunk=64, value_keys=16,
                                                     prep="kernel"),
                                 sm.MgpuSparseConfig(logits_mma="fp8", **TWO_LAUNCHES),
                                 sm.MgpuSparseConfig(**ONE_WG, logits_mma="fp8", logits_chunk=64, prep="xla"),
                                 sm.MgpuSparseConfig(value_mma="fp8", logits_mma="fp8", **TWO_LAUNCHES),
                                 sm.MgpuSparseConfig(**ONE_WG, value_mma="fp8", prep="kernel", merge="last"),
                                 sm.MgpuSparseConfig(gather="lsu"), sm.MgpuSparseConfig(**ONE_WG, gather="lsu"),
                                 sm.MgpuSparseConfig(mma_wait="chunk"),
                                 sm.MgpuSparseConfig(**WG4_CHUNK_WAIT),
                                 sm.MgpuSparseConfig(value_mma="fp8", logits_mma="fp8", mma_wait="chunk",
                                                     **TWO_LAUNCHES)])
def test_kernel_lowers_for_cuda_at_k31_shapes(cfg, monkeypatch):
    if not triton_call.available():  # merge="kernel": the Triton merge is a jax-triton launch, which lowers only
        # with a GPU jaxlib; stand in for it here (its sm_90 compile: tests/test_triton_compile.py)
        def merge_stand_in(args, *, out_shape, **kw):  # reads the partials, so the kernel's call stays in
            return [jnp.broadcast_to(jnp.sum(args[0]).astype(o.dtype), o.shape) for o in out_shape]

        monkeypatch.setattr(triton_call, "_gpu_launch", merge_stand_in)
    fmt = Q.LatentFormat("fp8", R, ROPE)
    q_dtype = jnp.bfloat16 if cfg.warpgroups == 4 and cfg.prep == "kernel" else jnp.float32  # raw bf16 q too
    args = (jax.ShapeDtypeStruct((4, 12, C), q_dtype), jax.ShapeDtypeStruct((256, 64, C), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((4, 64), jnp.int32), jax.ShapeDtypeStruct((4, 2048), jnp.int32))
    f = jax.jit(lambda q, pool, bt, idx: sm.decode(q, (pool,), bt, idx, fmt=fmt, scale=SCALE, value_dim=R,
                                                   config=cfg))
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


# ------------------------------------------------------------------------------------------------------------ device

@pytest.mark.gpu
@pytest.mark.parametrize("H,k,splits,warpgroups,merge,prep", [
    (12, 2048, 8, 1, "kernel", "xla"), (16, 300, 4, 1, "kernel", "xla"), (4, 2048, 2, 1, "kernel", "xla"),
    (12, 300, 2, 4, "kernel", "xla"), (12, 2048, 4, 2, "last", "xla"), (16, 300, 8, 1, "last", "xla"),
    (4, 300, 2, 4, "last", "xla"), (12, 2048, 4, 2, "last", "kernel"), (16, 300, 8, 1, "kernel", "kernel"),
    (4, 300, 2, 4, "last", "kernel"), (12, 300, 4, 2, "kernel", "kernel-bf16"), (12, 2048, 4, 2, "kernel", "fp8"),
    (16, 300, 8, 1, "last", "fp8"), (4, 300, 2, 4, "kernel", "fp8"), (12, 2048, 4, 2, "kernel", "fp8-fp8"),
    (16, 300, 8, 1, "last", "xla-fp8v"), (4, 300, 2, 4, "last", "kernel-fp8v")])
def test_gpu_mgpu_sparse_mla_matches_reference(H, k, splits, warpgroups, merge, prep):
    parts, bt, idx, q, kw = case(seed=3, H=H, k=k)
    if prep == "kernel-bf16":  # the kernel reads raw bf16 q; the reference gets the same values
        q_in, prep = jnp.asarray(q, jnp.bfloat16), "kernel"
        q = np.asarray(q_in.astype(jnp.float32))
    else:
        q_in = q
    idx[1, 100:] = -1
    idx[2] = -1
    o_r, lse_r = sparse.decode(q, parts, bt, idx, backend="reference", **kw)
    # "fp8": the logits on e4m3 tensor cores; "…fp8v" / "fp8-fp8": the PV product too
    value_mma = "fp8" if prep.endswith("fp8v") or prep == "fp8-fp8" else "f16"
    prep = prep.removesuffix("-fp8v").replace("fp8-fp8", "fp8")
    mma, prep = ("fp8", "xla") if prep == "fp8" else ("f16", prep)
    cfg = sm.MgpuSparseConfig(splits=splits, warpgroups=warpgroups, merge=merge, prep=prep, logits_mma=mma,
                              value_mma=value_mma,
                              **(dict(stages=1, logits_chunk=64, value_keys=16) if warpgroups == 4 else {}))
    o, lse = sm.decode(q_in, parts, bt, idx, config=cfg, **kw)
    o, lse = np.asarray(o), np.asarray(lse)
    assert (o[2] == 0).all() and (lse[2] == -np.inf).all()
    assert rel_rms(o[:2], np.asarray(o_r)[:2]) <= 5e-3 and rel_rms(lse[:2], np.asarray(lse_r)[:2]) <= 5e-3


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [dict(ONE_WG, stages=3), dict(ONE_WG, logits_chunk=64, value_keys=16),
                                 dict(ONE_WG, logits_chunk=576, value_keys=64), dict(ONE_WG, logits_accs=3),
                                 dict(ONE_WG, logits_chunk=64, logits_accs=9),
                                 dict(splits=4, stages=1, warpgroups=4, logits_chunk=64, value_keys=16),
                                 TWO_LAUNCHES, {}, dict(gather="lsu"), dict(ONE_WG, gather="lsu"),
                                 dict(splits=4, stages=1, warpgroups=4, logits_chunk=64, value_keys=16, gather="lsu"),
                                 dict(mma_wait="chunk"), WG4_CHUNK_WAIT,
                                 dict(WG4_CHUNK_WAIT, logits_chunk=192, value_keys=32)])
def test_gpu_mgpu_sparse_mla_configs(cfg):
    parts, bt, idx, q, kw = case(seed=4, H=12, k=2048)
    o_r, lse_r = sparse.decode(q, parts, bt, idx, backend="reference", **kw)
    o, lse = sm.decode(q, parts, bt, idx, config=sm.MgpuSparseConfig(**cfg), **kw)
    assert rel_rms(o, o_r) <= 5e-3 and rel_rms(lse, lse_r) <= 5e-3


@pytest.mark.gpu
def test_gpu_lsu_gather_with_empty_slots_matches_reference():
    """gather="lsu" (16-byte cp.async chunks): a short selection (k = 300, padded with empty slots), a sequence cut
    at 100 keys and one with no key at all, as the TMA gather is checked above."""
    parts, bt, idx, q, kw = case(seed=5, H=12, k=300)
    idx[1, 100:] = -1
    idx[2] = -1
    o_r, lse_r = sparse.decode(q, parts, bt, idx, backend="reference", **kw)
    o, lse = sm.decode(q, parts, bt, idx, config=sm.MgpuSparseConfig(gather="lsu"), **kw)
    o, lse = np.asarray(o), np.asarray(lse)
    assert (o[2] == 0).all() and (lse[2] == -np.inf).all()
    assert rel_rms(o[:2], np.asarray(o_r)[:2]) <= 5e-3 and rel_rms(lse[:2], np.asarray(lse_r)[:2]) <= 5e-3


@pytest.mark.gpu
def test_gpu_timeline_leaves_the_result_and_stamps_in_order():
    """trace=True: the same o as without, and every CTA warpgroup's stamps in program order."""
    parts, bt, idx, q, kw = case(seed=6, H=12, k=2048)
    cfg = sm.MgpuSparseConfig()
    (pool,) = parts
    nb, page, c = pool.shape
    pool_u8 = jax.lax.bitcast_convert_type(pool, jnp.uint8).reshape(nb * page, c)
    slots = sm.prepare_slots(jnp.asarray(idx), cfg.splits, cfg.warpgroups)
    call = functools.partial(sm.kernel_call, jnp.asarray(q), None, slots, jnp.asarray(bt), pool_u8, R=R, page=page,
                             config=cfg, H=12, layer_scale=0.5, scale=kw["scale"])
    o, lse = call()
    o_t, lse_t, trace = call(trace=True)
    assert (np.asarray(o_t) == np.asarray(o)).all() and (np.asarray(lse_t) == np.asarray(lse)).all()
    t = mla_trace.trace_ns(trace)
    assert (np.diff(t, axis=-1) >= 0).all() and (t[..., -1] > t[..., 0]).all()


def test_gather_must_be_tma_or_lsu():
    with pytest.raises(ValueError, match="gather"):
        sm.MgpuSparseConfig(gather="dma")


@pytest.mark.parametrize("cfg", [sm.MgpuSparseConfig(), sm.MgpuSparseConfig(**ONE_WG, **TWO_LAUNCHES)])
def test_kernel_with_a_timeline_lowers_for_cuda(cfg):
    """trace=True (a diagnostic): one more output, each CTA warpgroup's globaltimer stamps."""
    B, NS, NW = 4, cfg.splits, cfg.warpgroups
    q_shape = (B, 12, C) if cfg.prep == "kernel" else (B, sm.HEADS, C)
    args = (jax.ShapeDtypeStruct(q_shape, jnp.float32 if cfg.prep == "kernel" else jnp.float16),
            None if cfg.prep == "kernel" else jax.ShapeDtypeStruct((B, sm.HEADS), jnp.float32),
            jax.ShapeDtypeStruct((B, NS, 2048 // 64 // NS, 64), jnp.int32), jax.ShapeDtypeStruct((B, 64), jnp.int32),
            jax.ShapeDtypeStruct((256 * 64, C), jnp.uint8))
    f = jax.jit(lambda q, c2, slots, bt, pool: sm.kernel_call(q, c2, slots, bt, pool, R=R, page=64, config=cfg, H=12,
                                                              scale=SCALE, trace=True))
    out = jax.eval_shape(f, *args)
    assert out[-1].shape == (NS, B, NW, 5 + 2 * (2048 // 64 // NS // NW)) and out[-1].dtype == jnp.int32
    assert "globaltimer" in f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_trace_phases_reads_each_ctas_timeline():
    n = 2  # blocks per warpgroup: stamps start, translated, q, (arrived, computed) x 2, finished, merged
    row = np.array([0, 1000, 3000, 5000, 9000, 9500, 13000, 14000, 16000])
    trace = np.stack([row, row + 2000])[:, None, None, :].astype(np.int64)  # 2 splits, 1 sequence, 1 warpgroup
    trace[1, ..., :] += (1 << 32) - 3000  # the second CTA's timer wraps past 2^32 mid-row
    trace = (trace % (1 << 32)).astype(np.int64).astype(np.int32)
    ph = mla_trace.trace_phases(trace, n)
    assert ph["slots + translate"] == (1.0, 1.0) and ph["block 0 wait gather"] == (2.0, 2.0)
    assert ph["block 1 compute"] == (3.5, 3.5) and ph["last merge"] == (2.0, 2.0)
    assert ph["CTA total"] == (16.0, 16.0)
