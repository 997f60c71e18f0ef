"""Dense paged MLA (`pallas_kernels.mla.paged_dense`): each query attends to every cached position ≤ its own.

The oracle is `sparse.sparse_mla` (reference backend) with idx = every position ≤ query_pos; the reference, the TPU
decode kernel (TPU interpret mode on CPU) and the GPU one (Triton's interpreter) must all equal it: bf16 / fp32 / fp8
rows (the GPU kernel: bf16 / fp8 / nvfp4), lengths that end inside a page, on a page boundary, at position 0, padding
queries (pos < 0: o = 0, lse = −inf), a batch split into several kernel calls by the SMEM budget, and the GPU
kernel's splits of each sequence's own length. The TPU kernel also exports for TPU (`jax.export`) at tiny and
full-size dims.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimi_jax import quant as Q
from pallas_kernels import budget
from pallas_kernels.mla import paged_dense, paged_dense_tpu, sparse

PAGE, NB = 16, 14
BT = np.array([[3, 1, 7, 5], [2, 9, 0, 13], [11, 4, 6, 8], [10, 12, 0, 0]], np.int32)
R, ROPE, H = 32, 8, 4
SCALE = 0.3


def rel_rms(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2) / max(np.mean(b ** 2), 1e-30)))


def case(kv_dtype, seed=0, B=4, T=1):
    rng = np.random.default_rng(seed)
    fmt = Q.LatentFormat(kv_dtype, R, ROPE)
    rows = jnp.asarray(rng.standard_normal((NB, PAGE, R + ROPE)), jnp.float32)
    layer_scale = 0.05 if kv_dtype == "fp8" else 1.0
    parts = fmt.quantize(rows, layer_scale)
    q = jnp.asarray(rng.standard_normal((B, T, H, R + ROPE)), jnp.float32)
    return fmt, parts, q, layer_scale


def oracle(q, parts, bt, pos_bt, fmt, layer_scale):
    """sparse_mla over idx = every position ≤ query_pos (−1 elsewhere)."""
    S = bt.shape[1] * PAGE
    s = np.arange(S)[None, None, :]
    idx = np.where(s <= np.asarray(pos_bt)[..., None], s, -1).astype(np.int32)
    return sparse.sparse_mla(q, parts, bt, idx, fmt=fmt, scale=SCALE, value_dim=R, layer_scale=layer_scale,
                             backend="reference")


def assert_equal_attention(got, want, bar, lse_rtol=0.0):
    (o, lse), (o_w, lse_w) = got, want
    lse, lse_w = np.asarray(lse), np.asarray(lse_w)
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(lse_w))
    fin = np.isfinite(lse_w)
    np.testing.assert_allclose(lse[fin], lse_w[fin], rtol=lse_rtol, atol=0 if lse_rtol else bar)
    assert rel_rms(o, o_w) < bar
    np.testing.assert_array_equal(np.asarray(o)[~fin], 0.0)


# decode positions: inside the 4th page, on the 2nd page's last slot, position 0, padding
POS = np.array([[57], [31], [0], [-1]], np.int32)


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8", "fp32"])
@pytest.mark.parametrize("backend", ["reference", "tpu_interpret"])
def test_decode_equals_sparse_mla_over_every_position(kv_dtype, backend):
    fmt, parts, q, ls = case(kv_dtype)
    got = paged_dense.dense_paged_mla(q, parts, BT, POS, fmt=fmt, scale=SCALE, value_dim=R, layer_scale=ls,
                                      backend=backend)
    assert got[0].shape == (4, 1, H, R) and got[1].shape == (4, 1, H)
    assert got[0].dtype == got[1].dtype == jnp.float32
    assert_equal_attention(got, oracle(q, parts, BT, POS, fmt, ls), 1e-5)


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_gpu_decode_equals_sparse_mla_over_every_position(kv_dtype):
    fmt, parts, q, ls = case(kv_dtype)
    got = paged_dense.dense_paged_mla(q, parts, BT, POS, fmt=fmt, scale=SCALE, value_dim=R, layer_scale=ls,
                                      backend="gpu_interpret")
    assert got[0].shape == (4, 1, H, R) and got[1].shape == (4, 1, H)
    assert_equal_attention(got, oracle(q, parts, BT, POS, fmt, ls), 1e-4, lse_rtol=1e-4)


def test_gpu_decode_splits_each_sequence_by_its_own_length():
    """The GPU kernel walks positions 0 … p itself: however many splits share a sequence (one, more than its
    blocks, a split count that leaves empty splits), in both precisions and with the storage preset that prepares q
    inside the kernel, the result is the sparse kernel's over the full selection. nvfp4 rows (two nibble planes)
    too."""
    from pallas_kernels.mla import sparse_gpu_triton

    pos = np.array([61, 31, 0, -1, 17], np.int32)
    bt = np.concatenate([BT, BT[:1]])
    for kv_dtype in ("fp8", "nvfp4"):
        fmt, parts, q, ls = case(kv_dtype, seed=7, B=5)
        want = oracle(q, parts, bt, pos[:, None], fmt, ls)
        presets = [dict(sparse_gpu_triton.WIDE["sr16_bk32_s5_qi"], splits=4)] if kv_dtype == "fp8" else []  # q inside
        for kw in [dict(splits=1), dict(splits=3), dict(splits=8, block_k=16), dict(exact=False, merge="triton")] + \
                presets:
            o, lse = sparse_gpu_triton.causal_decode(q[:, 0], parts, bt, pos, fmt=fmt, scale=SCALE, value_dim=R,
                                                     layer_scale=ls, interpret=True, **kw)
            bar = 1e-4 if kw.get("exact", True) else 5e-3
            assert_equal_attention((o[:, None], lse[:, None]), want, bar, lse_rtol=bar)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_gpu_decode_at_kimi_linear_width(kv_dtype):
    """On the device at Kimi-Linear's MLA widths (R = 512, rope = 64, 32 heads, 64-token pages): "auto" takes the
    GPU kernel for a decode step, which equals the reference within the exact bar (1e-4) and, at storage precision,
    within 5e-3."""
    rng = np.random.default_rng(2)
    fmt, page, nb = Q.LatentFormat(kv_dtype, 512, 64), 64, 48
    parts = fmt.quantize(jnp.asarray(rng.standard_normal((nb, page, 576)), jnp.float32), 0.05)
    bt = np.stack([rng.permutation(nb)[:16] for _ in range(3)]).astype(np.int32)
    pos = np.array([[1000], [64], [-1]], np.int32)
    q = jnp.asarray(rng.standard_normal((3, 1, 32, 576)), jnp.float32)
    kw = dict(fmt=fmt, scale=0.04, value_dim=512, layer_scale=0.05)
    s = np.arange(16 * page)[None, None, :]
    want = sparse.sparse_mla(q, parts, bt, np.where(s <= pos[..., None], s, -1).astype(np.int32),
                             backend="reference", **kw)
    assert paged_dense.resolve_dsa_backend("auto", op="t", supported=lambda k: paged_dense._kernel_supports(
        k, fmt, 1, parts)) == "gpu"
    for precision, bar in (("exact", 1e-4), ("storage", 5e-3)):
        got = paged_dense.dense_paged_mla(q, parts, bt, pos, precision=precision, **kw)
        assert_equal_attention(got, want, bar, lse_rtol=bar)


def test_kernel_pages_per_step_and_batch_split():
    """Several pages per grid step (including a step past the table's end), and a batch split into one-row calls
    by a small SMEM budget, give the same result."""
    fmt, parts, q, ls = case("bf16", seed=3)
    want = oracle(q, parts, BT, POS, fmt, ls)
    for pps in (1, 3, 4):
        o, lse = paged_dense_tpu.decode(q[:, 0], parts, BT, POS[:, 0], fmt=fmt, scale=SCALE, value_dim=R,
                                        pages_per_step=pps, interpret=True)
        assert_equal_attention((o[:, None], lse[:, None]), want, 1e-5)
    o, lse = paged_dense_tpu.decode(q[:, 0], parts, BT, POS[:, 0], fmt=fmt, scale=SCALE, value_dim=R,
                                    pages_per_step=4, smem_budget=paged_dense_tpu.smem_bytes_per_row(4),
                                    interpret=True)  # one row per call
    assert_equal_attention((o[:, None], lse[:, None]), want, 1e-5)


def test_prefill_reference_equals_sparse_mla():
    """T > 1 (the reference path): causal positions start … start+T−1, a padded tail, a chunked query axis."""
    fmt, parts, q, ls = case("fp8", seed=5, B=2, T=5)
    pos = np.array([[40, 41, 42, 43, 44], [13, 14, 15, 16, -1]], np.int32)
    bt = BT[:2]
    want = oracle(q, parts, bt, pos, fmt, ls)
    for q_chunk in (None, 2):
        for pages_per_step in (None, 1, 3):  # 3: the table's 4 pages in a full step and a padded one
            got = paged_dense.reference(q, parts, bt, pos, ls, fmt=fmt, scale=SCALE, value_dim=R, q_chunk=q_chunk,
                                        pages_per_step=pages_per_step)
            assert_equal_attention(got, want, 1e-5)
    got = paged_dense.dense_paged_mla(q, parts, bt, pos, fmt=fmt, scale=SCALE, value_dim=R, layer_scale=ls,
                                      backend="auto", platform="tpu")  # prefill: auto takes the reference
    assert_equal_attention(got, want, 1e-5)


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_prefill_at_storage_precision_is_within_the_storage_bar(kv_dtype):
    """precision="storage" (bf16 operands, fp32 accumulation: the tensor-core form) stays within the quantised
    formats' 5e-3 bar of the exact definition, keeps padding queries at o = 0, lse = −inf, and takes a whole chunk
    of queries in one slice."""
    fmt, parts, q, ls = case(kv_dtype, seed=11, B=2, T=5)
    pos = np.array([[40, 41, 42, 43, 44], [13, 14, 15, 16, -1]], np.int32)
    bt = BT[:2]
    want = oracle(q, parts, bt, pos, fmt, ls)
    for pages_per_step in (None, 3):
        got = paged_dense.reference(q, parts, bt, pos, ls, fmt=fmt, scale=SCALE, value_dim=R,
                                    pages_per_step=pages_per_step, precision="storage")
        assert_equal_attention(got, want, 5e-3, lse_rtol=5e-3)
    got = paged_dense.dense_paged_mla(q, parts, bt, pos, fmt=fmt, scale=SCALE, value_dim=R, layer_scale=ls,
                                      precision="storage")
    assert_equal_attention(got, want, 5e-3, lse_rtol=5e-3)
    with pytest.raises(ValueError, match="precision"):
        paged_dense.dense_paged_mla(q, parts, bt, pos, fmt=fmt, scale=SCALE, value_dim=R, precision="fast")


def test_storage_precision_runs_its_products_in_bf16_over_a_whole_prefill_chunk():
    """The storage form's two products take bf16 operands with fp32 results, and a 4,096-query chunk of 32 heads
    is one query slice (the exact form's 64 MiB budget cuts it into many, each a serial loop over the pages)."""
    fmt = Q.LatentFormat("bf16", 512, 64)
    T, H_ = 4096, 32
    q = jax.ShapeDtypeStruct((1, T, H_, 576), jnp.bfloat16)
    parts = (jax.ShapeDtypeStruct((80, 64, 576), jnp.bfloat16),)
    bt = jax.ShapeDtypeStruct((1, 80), jnp.int32)
    pos = jax.ShapeDtypeStruct((1, T), jnp.int32)

    def hlo(precision):  # the lowered program's text
        f = functools.partial(paged_dense.reference, fmt=fmt, scale=0.1, value_dim=512, precision=precision)
        return jax.jit(f).lower(q, parts, bt, pos, 1.0).as_text()

    storage = [ln for ln in hlo("storage").splitlines() if "dot_general" in ln]
    assert [ln.split(" : ")[-1] for ln in storage] == [
        "(tensor<1x4096x32x576xbf16>, tensor<1x512x576xbf16>) -> tensor<1x4096x32x512xf32>",  # q · keys
        "(tensor<1x4096x32x512xbf16>, tensor<1x512x512xbf16>) -> tensor<1x4096x32x512xf32>"]  # weights · values
    exact = [ln for ln in hlo("exact").splitlines() if "dot_general" in ln]
    assert len(exact) == 2 and all(  # float32 products over 256-query slices
        "HIGHEST" in ln and ("tensor<1x256x32x576xf32>" in ln or "tensor<1x256x32x512xf32>, " in ln) for ln in exact)


def test_prefill_reference_reads_only_the_pages_before_its_queries():
    """A chunk early in a long table: what the pages past its furthest query hold (here NaN) cannot reach the
    result (the reference stops at the furthest query's page: its cost follows the queries, not the table's
    width)."""
    fmt, parts, q, ls = case("bf16", seed=7, B=1, T=3)
    pos = np.array([[16, 17, 18]], np.int32)  # pages 0 and 1 of the table
    bt = np.array([[3, 1, 7, 5, 2, 9, 13, 11]], np.int32)
    want = oracle(q, parts, bt[:, :2], pos, fmt, ls)
    poisoned = tuple(p.at[np.array([7, 5, 2, 9, 13, 11])].set(jnp.nan) if jnp.issubdtype(p.dtype, jnp.floating)
                     else p for p in parts)
    got = paged_dense.reference(q, poisoned, bt, pos, ls, fmt=fmt, scale=SCALE, value_dim=R, pages_per_step=2)
    assert_equal_attention(got, want, 1e-5)


def test_auto_picks_the_tpu_kernel_only_for_the_tpu_platform():
    fmt, parts, q, ls = case("bf16")
    pick = lambda fmt, T, platform, parts=parts: paged_dense.resolve_dsa_backend(  # noqa: E731
        "auto", op="x", platform=platform,
        supported=lambda kind: paged_dense._kernel_supports(kind, fmt, T, tuple(parts)))
    assert pick(fmt, 1, "tpu") == "tpu"
    assert pick(fmt, 2, "tpu") == "reference"
    assert pick(fmt, 1, "cpu") == "reference" and pick(fmt, 1, "gpu") == "reference"
    nv = Q.LatentFormat("nvfp4", 512, 64)
    assert pick(nv, 1, "tpu", tuple(jnp.zeros((1, 16, p.width), p.dtype) for p in nv.parts)) == "reference"


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("H,R_,rope,kv_dtype,B,max_blocks", [
    (2, 32, 8, "bf16", 4, 8),        # tiny
    (1, 32, 8, "fp32", 4, 8),        # tiny, heads / 2
    (32, 512, 64, "bf16", 8, 2048),  # Kimi-Linear 48B, 128K context
    (4, 512, 64, "fp8", 256, 2048),  # Kimi-Linear heads / 8, B = 256: the tables are split over calls
    (96, 512, 64, "fp8", 16, 16384),  # K3.1 Pro, 1M context
    (12, 512, 64, "bf16", 16, 512),  # K3.1 Pro heads / 8
])
def test_kernel_exports_for_tpu(H, R_, rope, kv_dtype, B, max_blocks):
    fmt = Q.LatentFormat(kv_dtype, R_, rope)
    f = functools.partial(paged_dense_tpu.decode, fmt=fmt, scale=0.1, value_dim=R_)
    args = (_sds((B, H, R_ + rope), jnp.bfloat16), tuple(_sds((64, 64, p.width), p.dtype) for p in fmt.parts),
            _sds((B, max_blocks), jnp.int32), _sds((B,), jnp.int32))
    exp = jax.export.export(jax.jit(f), platforms=["tpu"])(*args)
    assert "tpu_custom_call" in exp.mlir_module()
    assert paged_dense_tpu.vmem_bytes(H, R_ + rope, R_, 64, 8, fmt.parts[0].dtype) <= budget.VMEM_BUDGET


@pytest.mark.parametrize("precision", ["exact", "storage"])
def test_a_gpu_prefill_chunk_reads_pages_not_an_index_over_the_table(precision):
    """`sharding.dsa.dense_attention` for a GPU: a prefill chunk (T > 1) takes the paged reference — keys read page
    by page, shared by the chunk's queries, at the configured precision — not the sparse op over an index of every
    table position per query (`[B, T, table width]`, a gather per query); the result is the same attention."""
    from sharding import dsa
    from sharding.context import ForwardContext, KernelConfig

    fmt, parts, q, ls = case("fp8", seed=5, B=2, T=5)
    pos = np.array([[40, 41, 42, 43, 44], [13, 14, 15, 16, -1]], np.int32)
    bt = BT[:2]
    ctx = ForwardContext(kernels=KernelConfig(dsa_precision=precision), platform="gpu")
    run = lambda q: dsa.dense_attention(ctx, q, parts, bt, pos, ls, fmt=fmt, scale=SCALE, value_dim=R)  # noqa: E731
    bar = 1e-5 if precision == "exact" else 5e-3
    assert_equal_attention(run(q), oracle(q, parts, bt, pos, fmt, ls), bar, lse_rtol=0.0 if bar == 1e-5 else bar)
    width = bt.shape[1] * PAGE
    jaxpr = str(jax.make_jaxpr(run)(q))
    assert f"i32[2,5,{width}]" not in jaxpr and "gather" in jaxpr  # pages gathered, no per-query index
