"""Every TPU kernel is legal for Mosaic at every preset's dims, and "auto" picks it when the target is a TPU.

Exports with `jax.export` for platform "tpu" from this CPU (Mosaic's block rules apply at export; interpret mode
does not check them) at the `tiny`, K3.1 Pro (= K3.1-reduced's attention), Kimi-Linear 48B and DeepSeek-V3.2 dims,
with heads divided by 1, 2, 4 and 8 (tensor-parallel shards), bf16 and fp32 activations and every cache format each
kernel reads. Also: `platform=` on the op entry points, the SMEM batch split of the paged kernels, and that
`pallas_kernels` imports no project package.
"""

from __future__ import annotations

import functools
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimi_jax import quant as Q
from pallas_kernels import budget
from pallas_kernels.indexer import paged as ipaged
from pallas_kernels.indexer import tpu as itpu
from pallas_kernels.kda import ops as kops
from pallas_kernels.kda import tpu as ktpu
from pallas_kernels.mla import paged_dense, paged_dense_tpu, sparse, sparse_tpu
from pallas_kernels.moe import mxfp4 as mx
from pallas_kernels.moe import ops as mops
from pallas_kernels.moe import tpu as mtpu
from pallas_kernels.moe.activations import situ
from pallas_kernels.paged import resolve_dsa_backend

S = jax.ShapeDtypeStruct
ACT_DTYPES = (jnp.bfloat16, jnp.float32)
TP = (1, 2, 4, 8)

# (name, heads, head_dim) of the KDA layers
KDA_DIMS = [("tiny", 2, 16), ("kimi-k3.1-pro", 96, 128), ("kimi-linear-48b", 32, 128)]
# (name, heads, latent R, rope) of the MLA layers
MLA_DIMS = [("tiny", 2, 32, 8), ("kimi-k3.1-pro", 96, 512, 64), ("kimi-linear-48b", 32, 512, 64),
            ("deepseek-v3.2", 128, 512, 64)]
# (name, heads, head_dim) of the DSA indexers
INDEX_DIMS = [("tiny", 2, 32), ("kimi-k3.1-pro", 32, 128), ("deepseek-v3.2", 64, 128)]
# (name, routed width D, expert width F, experts)
MOE_DIMS = [("tiny", 64, 32, 8), ("kimi-k3.1-pro", 3584, 3072, 8), ("kimi-linear-48b", 2304, 1024, 8),
            ("deepseek-v3.2", 7168, 2048, 8)]


def shards(n):
    return [n // t for t in TP if n % t == 0]


def exported(f, *args) -> str:
    return jax.export.export(jax.jit(f), platforms=["tpu"])(*args).mlir_module()


def assert_mosaic(f, *args):
    assert "tpu_custom_call" in exported(f, *args)


# ------------------------------------------------------------------------------------------------ platform=

def test_auto_resolves_against_the_platform_argument():
    assert kops.resolve_backend("auto", platform="tpu") == "tpu"
    assert kops.resolve_backend("auto", platform="cpu") == "reference"
    assert kops.resolve_backend("auto", platform="cuda") in ("gpu", "reference")  # no jax-triton -> reference
    assert mops.resolve_backend("auto", platform="tpu") == "tpu"
    assert mops.resolve_backend("auto", platform="cpu") == "reference"
    assert mops.resolve_backend("auto", platform="gpu") in (mops.GPU_CHOICE["bf16"], "reference")  # as KDA
    yes = lambda kind: True  # noqa: E731
    assert resolve_dsa_backend("auto", op="x", supported=yes, platform="tpu") == "tpu"
    assert resolve_dsa_backend("auto", op="x", supported=yes, platform="cuda") == "gpu"
    assert resolve_dsa_backend("auto", op="x", supported=yes, platform="cpu") == "reference"
    assert resolve_dsa_backend("auto", op="x", supported=lambda k: False, platform="tpu") == "reference"
    if jax.default_backend() == "cpu":  # the default stays the host's backend
        assert kops.resolve_backend("auto") == "reference" and mops.resolve_backend("auto") == "reference"
    with pytest.raises(ValueError, match="unknown platform"):
        kops.resolve_backend("auto", platform="metal")


def test_auto_exports_the_mosaic_kernels_for_tpu_and_the_reference_for_cpu():
    B, H, d = 4, 2, 16
    kda = lambda *a, p: kops.recurrent(*a[:5], a[5], slot_ids=a[6], platform=p)  # noqa: E731
    kargs = (S((B, 1, H, d), jnp.bfloat16),) * 4 + (S((B, 1, H), jnp.bfloat16), S((8, H, d, d), jnp.float32),
                                                    S((B,), jnp.int32))
    fmt = Q.LatentFormat("bf16", 32, 8)
    mla_args = (S((B, 1, 2, 40), jnp.bfloat16), (S((16, 16, 40), jnp.bfloat16),), S((B, 4), jnp.int32))
    dense = lambda q, parts, bt, pos, p: paged_dense.dense_paged_mla(  # noqa: E731
        q, parts, bt, pos, fmt=fmt, scale=0.1, value_dim=32, platform=p)
    smla = lambda q, parts, bt, idx, p: sparse.sparse_mla(  # noqa: E731
        q, parts, bt, idx, fmt=fmt, scale=0.1, value_dim=32, platform=p)
    ifmt = Q.IndexKeyFormat("fp8", 32)
    index = lambda q, w, parts, bt, pos, p: ipaged.topk_indices(q, w, parts, bt, pos, 8, fmt=ifmt,  # noqa: E731
                                                                platform=p)
    iargs = (S((B, 1, 2, 32), jnp.float32), S((B, 1, 2), jnp.float32),
             tuple(S((16, 16, p.width), p.dtype) for p in ifmt.parts), S((B, 4), jnp.int32), S((B, 1), jnp.int32))
    ws = (S((8, 64, 32), jnp.bfloat16), S((8, 64, 32), jnp.bfloat16), S((8, 32, 64), jnp.bfloat16))
    moe = lambda x, idx, w, g, u, dn, p: mops.expert_ffn(x, idx, w, g, u, dn, situ, platform=p)  # noqa: E731
    margs = (S((B, 64), jnp.bfloat16), S((B, 2), jnp.int32), S((B, 2), jnp.float32)) + ws
    cases = [(kda, kargs), (dense, mla_args + (S((B, 1), jnp.int32),)),
             (smla, mla_args + (S((B, 1, 8), jnp.int32),)), (index, iargs), (moe, margs)]
    for f, args in cases:
        assert_mosaic(functools.partial(f, p="tpu"), *args)
        cpu = jax.export.export(jax.jit(functools.partial(f, p="cpu")), platforms=["cpu"])(*args).mlir_module()
        assert "tpu_custom_call" not in cpu


# ------------------------------------------------------------------------------------------------ legal blocks

@pytest.mark.parametrize("name,H,d", KDA_DIMS)
def test_kda_kernels_export_at_every_shard(name, H, d):
    cu = np.array([0, 7, 130])
    for h in shards(H):
        for dt in ACT_DTYPES:
            dec = lambda *a, h=h: ktpu.recurrent(*a[:5], a[5], a[6], A_log=jnp.zeros(h),  # noqa: E731
                                                 dt_bias=jnp.zeros(h * d), gate_form="lower_bound")
            assert_mosaic(dec, *((S((4, 1, h, d), dt),) * 4 + (S((4, 1, h), dt), S((8, h, d, d), jnp.float32),
                                                               S((4,), jnp.int32))))
        tok = S((1, 130, h, d), jnp.bfloat16)
        assert_mosaic(lambda *a: ktpu.chunk(*a[:5], cu, a[5]), tok, tok, tok, S((1, 130, h, d), jnp.float32),
                      S((1, 130, h), jnp.float32), S((2, h, d, d), jnp.float32))


@pytest.mark.parametrize("name,H,R,rope", MLA_DIMS)
def test_mla_kernels_export_at_every_shard(name, H, R, rope):
    topk, max_blocks = (8, 4) if name == "tiny" else (2048, 2048)  # 128K context at page 64
    for h in shards(H):
        for kv_dtype, dt in [("bf16", jnp.bfloat16), ("fp8", jnp.float32)]:
            fmt = Q.LatentFormat(kv_dtype, R, rope)
            parts = tuple(S((64, 64, p.width), p.dtype) for p in fmt.parts)
            q, bt = S((16, h, R + rope), dt), S((16, max_blocks), jnp.int32)
            assert_mosaic(functools.partial(sparse_tpu.decode, fmt=fmt, scale=0.1, value_dim=R), q, parts, bt,
                          S((16, topk), jnp.int32))
            assert_mosaic(functools.partial(paged_dense_tpu.decode, fmt=fmt, scale=0.1, value_dim=R), q, parts,
                          bt, S((16,), jnp.int32))


@pytest.mark.parametrize("name,Hi,d", INDEX_DIMS)
def test_indexer_kernel_exports_for_every_key_format(name, Hi, d):
    for index_dtype in itpu.SUPPORTED:
        fmt = Q.IndexKeyFormat(index_dtype, d)
        for h in shards(Hi)[:2]:
            assert_mosaic(functools.partial(itpu.scores, fmt=fmt), S((4, h, d), jnp.float32), S((4, h), jnp.float32),
                          tuple(S((100, 64, p.width), p.dtype) for p in fmt.parts), S((4, 40), jnp.int32),
                          S((4,), jnp.int32))


@pytest.mark.parametrize("name,D,F,E", MOE_DIMS)
def test_moe_grouped_matmul_exports_at_every_shard(name, D, F, E):
    for f in shards(F):
        for dt in ACT_DTYPES:
            gs = S((E,), jnp.int32)
            up = lambda x, g, u, n: mtpu.grouped_matmul(x, (g, u), n, activation=situ)  # noqa: E731
            assert_mosaic(up, S((64, D), dt), S((E, D, f), dt), S((E, D, f), dt), gs)
            assert_mosaic(lambda h, w, n: mtpu.grouped_matmul(h, (w,), n), S((64, f), dt), S((E, f, D), dt), gs)
        if f % mx.GROUP == 0:
            w = mx.MXFP4Weight(S((E, f, D // 2), jnp.uint8), S((E, f, D // mx.GROUP), jnp.uint8))
            assert_mosaic(lambda x, p, s, n: mtpu.grouped_matmul(x, (mx.MXFP4Weight(p, s),), n),
                          S((64, D), jnp.bfloat16), w.packed, w.scale, S((E,), jnp.int32))


# ------------------------------------------------------------------------------------------------ budgets

def test_k31_pro_kernels_fit_vmem_and_their_tables_fit_smem_per_call():
    """Full size, one device and one TP-8 shard: every kernel's blocks fit 16 MiB of VMEM; B = 256 sequences of
    128K tokens (2048 pages) with top-k 2048 need 4 MiB of sparse-MLA tables, so the batch is split into calls."""
    for H in (96, 12):
        assert sparse_tpu.vmem_bytes(H, 576, 512, 128, jnp.bfloat16) <= budget.VMEM_BUDGET
        assert paged_dense_tpu.vmem_bytes(H, 576, 512, 64, 8, jnp.bfloat16) <= budget.VMEM_BUDGET
    assert itpu.vmem_bytes(32, 128, 64, [(128, jnp.float8_e4m3fn), (1, jnp.float32)]) <= budget.VMEM_BUDGET
    per_row = sparse_tpu.smem_bytes_per_row(2048, 2048)
    assert 256 * per_row > budget.SMEM_BUDGET
    rows = budget.batch_rows_within(256, per_row)
    assert 1 <= rows < 256 and rows * per_row <= budget.SMEM_BUDGET
    with pytest.raises(budget.BudgetError, match="SMEM"):
        budget.batch_rows_within(1, 2 * budget.SMEM_BUDGET)
    with pytest.raises(budget.BudgetError, match="VMEM"):
        budget.check("k", vmem=budget.VMEM_BUDGET + 1, smem=0)


def test_split_batch_equals_one_call():
    """The paged kernels give the same result when their tables are split over several calls (interpret mode)."""
    rng = np.random.default_rng(0)
    B, page, nb, H, R, rope = 3, 16, 8, 2, 32, 8
    bt = np.array([[3, 1, 7], [2, 0, 5], [6, 4, 1]], np.int32)
    fmt = Q.LatentFormat("bf16", R, rope)
    parts = fmt.quantize(jnp.asarray(rng.standard_normal((nb, page, R + rope)), jnp.float32))
    q = jnp.asarray(rng.standard_normal((B, H, R + rope)), jnp.float32)
    idx = jnp.asarray([[0, 5, 17, -1], [3, 4, 40, 2], [1, 47, 30, 8]], jnp.int32)
    kw = dict(fmt=fmt, scale=0.2, value_dim=R, interpret=True)
    one = sparse_tpu.decode(q, parts, bt, idx, **kw)
    split = sparse_tpu.decode(q, parts, bt, idx, smem_budget=sparse_tpu.smem_bytes_per_row(4, 3), **kw)
    for a, b in zip(one, split):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ifmt = Q.IndexKeyFormat("bf16", 32)
    keys = ifmt.quantize(jnp.asarray(rng.standard_normal((nb, page, 32)), jnp.float32))
    qi, w, pos = jnp.asarray(rng.standard_normal((B, 2, 32)), jnp.float32), jnp.ones((B, 2)), jnp.array([40, 3, 47])
    one = itpu.scores(qi, w, keys, bt, pos, fmt=ifmt, interpret=True)
    split = itpu.scores(qi, w, keys, bt, pos, fmt=ifmt, interpret=True, smem_budget=itpu.smem_bytes_per_row(3))
    np.testing.assert_array_equal(np.asarray(one), np.asarray(split))


def test_kda_decode_at_head_dim_16_equals_the_reference():
    """The tiny preset's d = 16 decode (head-major blocks) in interpret mode, against the reference."""
    from pallas_kernels.kda import reference as R

    rng = np.random.default_rng(1)
    B, T, H, d = 2, 1, 2, 16
    q, k = (jnp.asarray(rng.standard_normal((B, T, H, d)) * 0.25, jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((B, T, H, d)), jnp.float32)
    g = jnp.asarray(-np.abs(rng.standard_normal((B, T, H, d))), jnp.float32)
    beta = jnp.asarray(rng.uniform(0, 1, (B, T, H)), jnp.float32)
    pool = jnp.asarray(rng.standard_normal((3, H, d, d)), jnp.float32)
    slots = jnp.array([2, 0], jnp.int32)
    o, new = kops.recurrent(q, k, v, g, beta, pool, slot_ids=slots, backend="tpu_interpret")
    o_r, new_r = R.recurrent_slots(q, k, v, g, beta, pool, slots)
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_r), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(new)[slots], np.asarray(new_r)[slots], rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------------ layering

def test_pallas_kernels_imports_no_project_package():
    code = """
import importlib, pkgutil, sys
import pallas_kernels
names = [m.name for m in pkgutil.walk_packages(pallas_kernels.__path__, "pallas_kernels.")]
for n in names:
    importlib.import_module(n)
bad = sorted(m for m in sys.modules if m.split(".")[0] in ("kimi_jax", "sharding", "convert"))
print(len(names), bad)
assert not bad, bad
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0, r.stdout + r.stderr


def test_moe_kernel_matches_megablox_in_interpret_mode():
    """jax's megablox grouped matmul and ours give the reference's result on the same rows (both in TPU interpret
    mode), at a tile-aligned shape and at tiny's dims; docs/kernels.md says why the MoE path keeps ours."""
    import importlib

    from pallas_kernels.moe import reference as R

    megablox = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")
    rng = np.random.default_rng(2)
    for M, K, N, E, sizes, tiling in [(256, 256, 256, 4, [100, 0, 120, 36], (128, 128, 128)),
                                      (16, 64, 32, 8, [2, 3, 0, 1, 4, 2, 2, 2], (16, 64, 32))]:
        x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((E, K, N)) * 0.05, jnp.bfloat16)
        gs = jnp.asarray(sizes, jnp.int32)
        want = np.asarray(R.grouped_matmul(x, w, gs))
        ours = mtpu.grouped_matmul(x, (w,), gs, interpret=True)
        theirs = megablox.gmm(x, w, gs, tiling=tiling, interpret=True)
        np.testing.assert_allclose(np.asarray(ours), want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(theirs), want, rtol=1e-5, atol=1e-5)
