"""DSA kernels (issue #5) against their references: the indexer's decode-score kernels (GPU: Pallas Triton lowering,
TPU: Mosaic) and the GPU sparse-MLA decode kernel (the TPU one is in tests/test_dsa_ops.py).

CPU: the kernels run in Pallas interpret mode (GPU kernels: `interpret=True`, TPU kernels: TPU interpret mode) on
small shapes, and lower to Triton / Mosaic at the K3.1 shapes (no device needed). `gpu`-marked tests run the GPU
kernels on a real device (skipped without one): `JAX_PLATFORMS=cuda python -m pytest tests/test_dsa_kernels.py -m gpu`.
Bars: fp32 math ≤ 1e-4 relative RMS vs the reference on the same (dequantised) rows; the selected top-k set equals the
reference's on untied scores.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimi_jax import quant as Q
from pallas_kernels.indexer import paged as ipaged
from pallas_kernels.mla import sparse, sparse_gpu
from pallas_kernels.paged import gather_pages, resolve_dsa_backend

# small CPU geometry: 12-page pools of 16 tokens, three sequences with interleaved pages and a short one
PAGE, NB = 16, 12
BT = np.array([[3, 1, 7, 5], [2, 9, 0, 0], [11, 4, 6, 8]], np.int32)
POS = np.array([59, 24, 63], np.int32)  # decode query position (its own key written) per sequence
HI, DI = 4, 64  # indexer heads, key width
R, ROPE, H = 64, 16, 4  # latent, rope, heads (H < block_h: heads are padded inside the GPU kernel)
SCALE = 0.3


def rel_rms(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.all(np.isfinite(a)), "non-finite values"
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b ** 2)))


def index_scores_f64(q_bhd, w_bh, keys_bsd, pos_b):
    """float64 NumPy transcription of SPEC §6 for one query per sequence: `[B, S]`, −inf where s > pos."""
    dots = np.matmul(np.asarray(q_bhd, np.float64), np.asarray(keys_bsd, np.float64).transpose(0, 2, 1))
    s = np.einsum("bh,bhs->bs", np.asarray(w_bh, np.float64), np.maximum(dots, 0.0))
    return np.where(np.arange(s.shape[1])[None] <= np.asarray(pos_b)[:, None], s, -np.inf)


def assert_same_topk(idx_bk, s_ref_bs, topk: int, rel_tol: float = 0.0):
    """The selected sets equal the exact top-k of the float64 scores; with rel_tol > 0, a disagreement is allowed
    only for keys whose score is within rel_tol·max|s| of the k-th best score (a numerical near-tie)."""
    idx_bk = np.asarray(idx_bk)
    for b in range(idx_bk.shape[0]):
        row = s_ref_bs[b]
        n_ok = int(np.isfinite(row).sum())
        order = np.argsort(-np.where(np.isfinite(row), row, -np.inf), kind="stable")
        want = set(order[: min(topk, n_ok)].tolist())
        got = set(int(i) for i in idx_bk[b] if i >= 0)
        assert len(got) == min(topk, n_ok) and (idx_bk[b][len(got):] == -1).all()
        diff = got ^ want
        if diff:
            assert rel_tol > 0, f"row {b}: {len(diff)} keys differ"
            cut = row[order[min(topk, n_ok) - 1]]
            scale = np.abs(row[np.isfinite(row)]).max()
            worst = max(abs(row[i] - cut) for i in diff) / scale
            assert worst <= rel_tol, f"row {b}: keys differ away from the cut (rel gap {worst:.2e})"


def index_case(index_dtype, seed=0, B=3, bt=BT, pos=POS, nb=NB, page=PAGE, hi=HI, d=DI):
    """Random keys in a pool, positive q / w (q·k > 0 almost surely: untied, relu-free scores)."""
    rng = np.random.default_rng(seed)
    fmt = Q.IndexKeyFormat(index_dtype, d)
    parts = fmt.quantize(jnp.asarray((1.0 + 0.5 * rng.standard_normal((nb, page, d))), jnp.float32))
    q = (0.5 + np.abs(rng.standard_normal((B, hi, d)))).astype(np.float32)
    w = (np.abs(rng.standard_normal((B, hi))) * (hi * d) ** -0.5).astype(np.float32)
    keys = np.asarray(fmt.dequantize(gather_pages(parts, bt)))
    return fmt, parts, q, w, index_scores_f64(q, w, keys, pos)


KERNEL_KW = {"gpu_interpret": dict(block_n=16, tokens_per_program=32), "tpu_interpret": {}}


# ------------------------------------------------------------------------------------------------ indexer

@pytest.mark.parametrize("index_dtype", ["fp8", "mxfp4", "bf16"])
@pytest.mark.parametrize("backend", ["gpu_interpret", "tpu_interpret"])
def test_indexer_kernel_scores_and_topk_match_reference(index_dtype, backend):
    fmt, parts, q, w, s_ref = index_case(index_dtype)
    s = np.asarray(ipaged.kernel_scores(q, w, parts, BT, POS, fmt=fmt, backend=backend, **KERNEL_KW[backend]))
    fin = np.isfinite(s_ref)
    np.testing.assert_array_equal(np.isfinite(s), fin)  # causal / length mask, both sequences' tails
    assert (s[~fin] == -np.inf).all() and rel_rms(s[fin], s_ref[fin]) <= 1e-5
    topk = 8
    idx = ipaged.decode(q, w, parts, BT, POS + 1, topk, fmt=fmt, backend=backend, kernel_kw=KERNEL_KW[backend])
    assert idx.shape == (3, topk) and idx.dtype == jnp.int32
    assert_same_topk(idx, s_ref, topk)
    ref = ipaged.decode(q, w, parts, BT, POS + 1, topk, fmt=fmt, backend="reference")
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(ref))


def test_indexer_kernel_short_sequence_keeps_every_key_and_pads():
    fmt, parts, q, w, s_ref = index_case("fp8", seed=1)
    pos = np.array([5, 0, -1], np.int32)  # 6 keys, 1 key, a padding query
    idx = np.asarray(ipaged.topk_indices(q[:, None], w[:, None], parts, BT, pos[:, None], 8, fmt=fmt,
                                         backend="gpu_interpret", kernel_kw=KERNEL_KW["gpu_interpret"]))[:, 0]
    np.testing.assert_array_equal(np.sort(idx[0, :6]), np.arange(6))
    assert (idx[0, 6:] == -1).all() and idx[1, 0] == 0 and (idx[1, 1:] == -1).all() and (idx[2] == -1).all()


@pytest.mark.parametrize("group", [8, 16])
def test_select_topk_two_stage_equals_lax_top_k_with_ties(group):
    rng = np.random.default_rng(2)
    s = rng.standard_normal((5, 4096)).astype(np.float32)
    s[1, 3000:] = -np.inf
    s[2, 100:] = -np.inf  # fewer allowed keys than k
    s[3] = np.round(s[3])  # massive ties: earlier position wins
    s[4, ::3] = -0.0  # −0.0 and +0.0 are one score
    s[4, 1::3] = 0.0
    for k in (16, 128, 512):
        got = np.asarray(ipaged.select_topk(jnp.asarray(s), k, group=group))
        norm = jnp.where(jnp.asarray(s) == 0, 0.0, jnp.asarray(s))
        v, i = jax.lax.top_k(norm, k)
        np.testing.assert_array_equal(got, np.where(np.isfinite(np.asarray(v)), np.asarray(i), -1))


# ------------------------------------------------------------------------------------------------ sparse MLA (GPU)

def mla_case(kv_dtype, seed=3, B=3, k=40, bt=BT, pos=POS, nb=NB, page=PAGE, r=R, rope=ROPE, h=H):
    rng = np.random.default_rng(seed)
    fmt = Q.LatentFormat(kv_dtype, r, rope)
    parts = fmt.quantize(jnp.asarray(rng.standard_normal((nb, page, r + rope)), jnp.float32), 0.5)
    idx = np.full((B, k), -1, np.int32)
    for b in range(B):
        cand = rng.permutation(int(pos[b]) + 1)[:k]
        idx[b, : len(cand)] = cand
    q = rng.standard_normal((B, h, r + rope)).astype(np.float32)
    kw = dict(fmt=fmt, layer_scale=jnp.float32(0.5), scale=SCALE, value_dim=r)
    return parts, idx, q, kw


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8", "nvfp4"])
def test_sparse_gpu_kernel_matches_reference_on_dequantised_rows(kv_dtype):
    parts, idx, q, kw = mla_case(kv_dtype)
    idx[0, 5] = -1  # an empty slot inside a block
    o_r, lse_r = sparse.decode(q, parts, BT, idx, backend="reference", **kw)
    # 5 key blocks of 8 over 2 splits (the second padded with empty slots), merged on the lse
    o, lse = sparse.decode(q, parts, BT, idx, backend="gpu_interpret", kernel_kw=dict(block_k=8, splits=2), **kw)
    assert o.shape == (3, H, R) and lse.shape == (3, H)
    assert rel_rms(o, o_r) <= 1e-4 and rel_rms(lse, lse_r) <= 1e-4


def test_sparse_gpu_kernel_fast_mode_and_empty_rows():
    parts, idx, q, kw = mla_case("fp8", seed=4)
    idx[2] = -1  # a sequence with no selected key: o = 0, lse = −inf
    o_r, lse_r = sparse.decode(q, parts, BT, idx, backend="reference", **kw)
    o, lse = sparse.decode(q, parts, BT, idx, backend="gpu_interpret", kernel_kw=dict(block_k=16, exact=False), **kw)
    o, lse = np.asarray(o), np.asarray(lse)
    assert (o[2] == 0).all() and (lse[2] == -np.inf).all()
    assert rel_rms(o[:2], np.asarray(o_r)[:2]) <= 5e-3  # bf16 q and p
    np.testing.assert_allclose(lse[:2], np.asarray(lse_r)[:2], rtol=5e-3)


def test_e2m1_arithmetic_decode_equals_the_table():
    codes = jnp.arange(16, dtype=jnp.int32)
    np.testing.assert_array_equal(np.asarray(sparse_gpu.e2m1_value(codes)), Q.E2M1_VALUES)


# ------------------------------------------------------------------------------------------------ backend choice

def test_auto_backend_is_the_reference_on_cpu_and_errors_are_clear():
    assert resolve_dsa_backend("auto", op="indexer", supported=lambda kind: True) == "reference"  # CPU
    assert resolve_dsa_backend("interpret", op="x", supported=None) == "tpu_interpret"  # older names
    assert resolve_dsa_backend("pallas_tpu", op="x", supported=None) == "tpu"
    # what "auto" would take on a GPU: the kernels at K3.1 shapes, the reference for the tiny preset's shapes
    from pallas_kernels.indexer import gpu as igpu

    assert igpu.fits(Q.IndexKeyFormat("fp8", 128), 32, 128) and igpu.fits(Q.IndexKeyFormat("mxfp4", 128), 32, 128)
    assert not igpu.fits(Q.IndexKeyFormat("fp8", 16), 2, 16)
    assert sparse_gpu.fits(Q.LatentFormat("nvfp4", 512, 64)) and not sparse_gpu.fits(Q.LatentFormat("fp8", 32, 8))
    with pytest.raises(ValueError, match="unknown indexer backend"):
        ipaged.topk_indices(np.zeros((1, 1, HI, DI), np.float32), np.zeros((1, 1, HI), np.float32), (), BT[:1],
                            np.zeros((1, 1), np.int32), 4, fmt=None, backend="cuda")
    fmt, parts, q, w, _ = index_case("fp8")
    with pytest.raises(ValueError, match="decode-only"):
        ipaged.topk_indices(np.zeros((3, 2, HI, DI), np.float32), np.zeros((3, 2, HI), np.float32), parts, BT,
                            np.zeros((3, 2), np.int32), 4, fmt=fmt, backend="gpu_interpret")
    with pytest.raises(ValueError, match="powers of two"):
        sparse_gpu.decode(np.zeros((1, H, 56), np.float32), (np.zeros((2, PAGE, 56), np.float32),), BT[:1],
                          np.zeros((1, 4), np.int32), fmt=Q.LatentFormat("fp8", 48, 8), scale=1.0, value_dim=48)


# ------------------------------------------------------------------------------------------------ lowering (no device)

def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("index_dtype", ["fp8", "mxfp4"])
def test_indexer_kernels_lower_at_k31_shapes(index_dtype):
    from pallas_kernels.indexer import gpu, tpu

    fmt = Q.IndexKeyFormat(index_dtype, 128)
    args = (_sds((2, 32, 128), jnp.float32), _sds((2, 32), jnp.float32),
            tuple(_sds((100, 64, p.width), p.dtype) for p in fmt.parts), _sds((2, 40), jnp.int32),
            _sds((2,), jnp.int32))
    txt = jax.jit(functools.partial(gpu.scores, fmt=fmt)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "xla.gpu.triton" in txt
    txt = jax.jit(functools.partial(tpu.scores, fmt=fmt)).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in txt


@pytest.mark.parametrize("kv_dtype", ["fp8", "nvfp4"])
def test_sparse_gpu_kernel_lowers_to_triton_at_k31_shapes(kv_dtype):
    fmt = Q.LatentFormat(kv_dtype, 512, 64)
    f = functools.partial(sparse_gpu.decode, fmt=fmt, scale=192 ** -0.5, value_dim=512)
    args = (_sds((2, 96, 576), jnp.float32), tuple(_sds((100, 64, p.width), p.dtype) for p in fmt.parts),
            _sds((2, 40), jnp.int32), _sds((2, 2048), jnp.int32))
    assert "xla.gpu.triton" in jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


# ------------------------------------------------------------------------------------------------ real GPU

def _has_gpu():
    try:
        return any(d.platform in ("gpu", "cuda") for d in jax.devices())
    except RuntimeError:
        return False


gpu_only = pytest.mark.skipif(not _has_gpu(), reason="needs a CUDA GPU")


def _big_pool(rng, n_seq, blocks_per_seq, extra=3):
    """Block tables `[n_seq, blocks_per_seq]` over a shuffled pool of n_seq·blocks_per_seq + extra pages."""
    nb = n_seq * blocks_per_seq + extra
    perm = rng.permutation(np.arange(1, nb))[: n_seq * blocks_per_seq]
    return nb, perm.reshape(n_seq, blocks_per_seq).astype(np.int32)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("index_dtype", ["fp8", "mxfp4"])
def test_gpu_indexer_decode_device(index_dtype):
    rng = np.random.default_rng(10)
    B, nbs, page, topk = 4, 256, 64, 2048  # 16K keys per sequence, K3.1 heads (32 × 128)
    nb, bt = _big_pool(rng, B, nbs)
    pos = np.array([16383, 9000, 2047, 1000], np.int32)  # the last two select every key
    fmt, parts, q, w, s_ref = index_case(index_dtype, seed=11, B=B, bt=bt, pos=pos, nb=nb, page=page, hi=32, d=128)
    s = np.asarray(ipaged.kernel_scores(q, w, parts, bt, pos, fmt=fmt, backend="gpu"))
    fin = np.isfinite(s_ref)
    np.testing.assert_array_equal(np.isfinite(s), fin)
    assert rel_rms(s[fin], s_ref[fin]) <= 1e-5
    assert resolve_dsa_backend("auto", op="indexer", supported=lambda kind: kind == "gpu") == "gpu"
    idx = ipaged.decode(q, w, parts, bt, pos + 1, topk, fmt=fmt)  # auto -> the GPU kernel
    assert_same_topk(idx, s_ref, topk, rel_tol=1e-5)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8", "nvfp4"])
@pytest.mark.parametrize("heads", [96, 12])
def test_gpu_sparse_mla_decode_device(kv_dtype, heads):
    rng = np.random.default_rng(12)
    B, nbs, page = 3, 64, 64  # 4K tokens per sequence
    nb, bt = _big_pool(rng, B, nbs)
    pos = np.array([4095, 3000, 1000], np.int32)  # the last one has fewer than k keys
    parts, idx, q, kw = mla_case(kv_dtype, seed=13, B=B, k=2048, bt=bt, pos=pos, nb=nb, page=page, r=512, rope=64,
                                 h=heads)
    kw["scale"] = 192 ** -0.5
    o_r, lse_r = sparse.decode(q, parts, bt, idx, backend="reference", **kw)  # fp32 at Precision.HIGHEST
    o, lse = sparse.decode(q, parts, bt, idx, **kw)  # auto -> the GPU kernel
    assert rel_rms(o, o_r) <= 1e-4 and rel_rms(lse, lse_r) <= 1e-4
    o_f, _ = sparse.decode(q, parts, bt, idx, backend="gpu", kernel_kw=dict(exact=False), **kw)
    assert rel_rms(o_f, o_r) <= 5e-3
