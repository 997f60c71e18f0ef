"""The GPU DSA indexer kernel (native Triton, `pallas_kernels.indexer.gpu_triton`) against its reference.

CPU: Triton's interpreter (backend "gpu_interpret"; tests/conftest.py sets TRITON_INTERPRET=1) on the small
geometry of tests/test_dsa_kernels.py, at the same bars: exact mode 1e-5 relative RMS of the scores vs a float64
transcription on the dequantised keys, the top-k equal to the reference's; single-pass settings at the storage
formats' 5e-3 bar (the interpreter rounds f32 -> fp8 by truncation, so those q planes are coarser here than on a
GPU). `gpu`-marked tests run the kernel through jax-triton on a device:
`JAX_PLATFORMS=cuda python -m pytest tests/test_triton_indexer.py -m gpu`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("triton")
pytest.importorskip("torch")

from test_dsa_kernels import (  # noqa: E402  (the shared small geometry and helpers)
    BT, POS, SMALL_BT, SMALL_POS, STORAGE_BAR, _big_pool, assert_same_topk, index_case, index_scores_f64, rel_rms)

from kimi_jax import quant as Q  # noqa: E402
from pallas_kernels.indexer import gpu_triton  # noqa: E402
from pallas_kernels.indexer import paged as ipaged  # noqa: E402
from pallas_kernels.paged import gather_pages  # noqa: E402

SMALL = dict(block_n=16, tokens_per_program=32)


def _check(s, s_ref, bar):
    fin = np.isfinite(s_ref)
    np.testing.assert_array_equal(np.isfinite(s), fin)  # causal / length mask, both sequences' tails
    assert (np.asarray(s)[~fin] == -np.inf).all()
    err = rel_rms(np.asarray(s)[fin], s_ref[fin])
    assert err <= bar, err
    return err


@pytest.mark.parametrize("index_dtype", ["fp8", "mxfp4", "bf16"])
def test_triton_indexer_scores_and_topk_match_reference(index_dtype):
    fmt, parts, q, w, s_ref = index_case(index_dtype)
    s = ipaged.kernel_scores(q, w, parts, BT, POS, fmt=fmt, backend="gpu_interpret", **SMALL)
    _check(s, s_ref, 1e-5)
    topk = 8
    idx = ipaged.decode(q, w, parts, BT, POS + 1, topk, fmt=fmt, backend="gpu_interpret", kernel_kw=SMALL)
    assert idx.shape == (3, topk) and idx.dtype == jnp.int32
    assert_same_topk(idx, s_ref, topk)
    ref = ipaged.decode(q, w, parts, BT, POS + 1, topk, fmt=fmt, backend="reference")
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(ref))


@pytest.mark.parametrize("kw", [dict(orient="qk"), dict(orient="kq", dot_dtype="bf16"), dict(tokens_per_program=None),
                                dict(orient="qk", prefetch=True)])
def test_triton_indexer_knobs_give_the_same_scores(kw):
    fmt, parts, q, w, s_ref = index_case("fp8", seed=5)
    q = q * 300.0  # large q: the per-head power-of-two normalisation keeps the f16 halves in range
    s = ipaged.kernel_scores(q, w, parts, BT, POS, fmt=fmt, backend="gpu_interpret", **dict(SMALL, **kw))
    _check(s, s_ref * 300.0, 1e-5)


@pytest.mark.parametrize("index_dtype", ["fp8", "bf16"])
@pytest.mark.parametrize("name", ["sp128_qk_s5_pf_qi", "sp64_kq_s6_pf_qi_1w_f8", "sp256_kq_s5_pf_qi_1w_f8"])
def test_triton_indexer_storage_presets_meet_the_storage_bar(index_dtype, name):
    """The single-pass presets (q prepared in the kernel; fp8 dots on the stored codes) at the 5e-3 bar, with the
    same chunking as the GPU (block_n from the preset, capped by the table's span)."""
    fmt, parts, q, w, s_ref = index_case(index_dtype, seed=7)
    s = ipaged.kernel_scores(q, w, parts, BT, POS, fmt=fmt, backend="gpu_interpret",
                             **dict(gpu_triton.FAST[name], tokens_per_program=32))
    _check(s, s_ref, STORAGE_BAR)


def test_triton_indexer_is_safe_against_garbage_table_entries():
    """Table entries past a sequence's pages may hold anything; block ids are clamped, chunks past pos not read."""
    fmt, parts, q, w, s_ref = index_case("fp8", seed=6)
    pos = np.array([20, 3, 40], np.int32)
    bt = BT.copy()
    bt[0, 2:] = [10**6, -7]
    bt[1, 1:] = [-1, 2**30, 5]
    s_ref = np.where(np.arange(s_ref.shape[1])[None] <= pos[:, None], s_ref, -np.inf)
    s = ipaged.kernel_scores(q, w, parts, bt, pos, fmt=fmt, backend="gpu_interpret", **SMALL)
    _check(s, s_ref, 1e-5)


def test_triton_indexer_short_sequence_keeps_every_key_and_pads():
    fmt, parts, q, w, _ = index_case("fp8", seed=1)
    pos = np.array([5, 0, -1], np.int32)  # 6 keys, 1 key, a padding query
    idx = np.asarray(ipaged.topk_indices(q[:, None], w[:, None], parts, BT, pos[:, None], 8, fmt=fmt,
                                         backend="gpu_interpret", kernel_kw=SMALL))[:, 0]
    np.testing.assert_array_equal(np.sort(idx[0, :6]), np.arange(6))
    assert (idx[0, 6:] == -1).all() and idx[1, 0] == 0 and (idx[1, 1:] == -1).all() and (idx[2] == -1).all()


@pytest.mark.parametrize("backend", ["gpu_interpret", pytest.param("gpu", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("hi", [2, 8])
def test_triton_indexer_pads_few_heads(backend, exact, hi):
    fmt, parts, q, w, s_ref = index_case("fp8", seed=21, B=2, bt=SMALL_BT, pos=SMALL_POS, nb=5, page=64, hi=hi, d=16)
    s = ipaged.kernel_scores(q, w, parts, SMALL_BT, SMALL_POS, fmt=fmt, backend=backend, exact=exact,
                             orient="qk" if not exact else "kq")
    _check(s, s_ref, 1e-5 if exact else STORAGE_BAR)


def test_triton_indexer_fits():
    assert gpu_triton.fits(Q.IndexKeyFormat("fp8", 128), 32, 128)
    assert not gpu_triton.fits(Q.IndexKeyFormat("fp8", 256), 32, 256)  # one fp8 scale group per token only
    assert gpu_triton.fits(Q.IndexKeyFormat("mxfp4", 128), 8, 128) and not gpu_triton.fits(
        Q.IndexKeyFormat("fp8", 8), 8, 8)


# ------------------------------------------------------------------------------------------------ device

def _gpu_case(index_dtype, **kernel_kw):
    rng = np.random.default_rng(10)
    B, nbs, page = 4, 256, 64  # 16K keys per sequence, K3.1 heads (32 × 128)
    nb, bt = _big_pool(rng, B, nbs)
    pos = np.array([16383, 9000, 2047, 1000], np.int32)
    fmt, parts, q, w, s_ref = index_case(index_dtype, seed=11, B=B, bt=bt, pos=pos, nb=nb, page=page, hi=32, d=128)
    s = np.asarray(ipaged.kernel_scores(q, w, parts, bt, pos, fmt=fmt, backend="gpu", **kernel_kw))
    return fmt, parts, bt, pos, q, w, s_ref, _check(s, s_ref, STORAGE_BAR)


@pytest.mark.gpu
@pytest.mark.parametrize("index_dtype", ["fp8", "mxfp4", "bf16"])
def test_gpu_triton_indexer_exact_mode_is_fp32_level(index_dtype):
    *_, err = _gpu_case(index_dtype)
    assert err <= 1e-5, f"hi/lo q split lost on the device? rel rms {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [16384, 131072])
def test_gpu_triton_indexer_storage_preset_selects_like_the_reference(tokens):
    fmt, parts, bt, pos, q, w, s_ref, err = _gpu_case("fp8", **gpu_triton.FAST[gpu_triton.storage_preset(tokens)])
    topk = 2048
    idx = ipaged.decode(q, w, parts, bt, pos + 1, topk, fmt=fmt, backend="gpu", precision="storage")
    assert_same_topk(idx, s_ref, topk, rel_tol=max(1e-5, 2 * err))  # disagreements only at near-ties


@pytest.mark.gpu
def test_gpu_triton_indexer_addresses_the_top_of_a_pool_over_2gib():
    """fp8 codes of 2.15 GB (rows past 2^31 / 128 bytes): the int64 row addressing, vs the reference."""
    rng = np.random.default_rng(20)
    page, nbs, B = 64, 64, 2
    fmt = Q.IndexKeyFormat("fp8", 128)
    nb = 2**31 // (page * 128) + 100
    bits = jax.random.bits(jax.random.PRNGKey(1), (nb, page, 128), jnp.uint8) & jnp.uint8(0xBF)
    codes = jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn)
    del bits
    sc = jnp.exp2(jax.random.randint(jax.random.PRNGKey(2), (nb, page, 1), -6, -1).astype(jnp.float32))
    parts = (codes, sc)
    bt = np.stack([nb - 1 - np.arange(nbs), nb - 1 - nbs - rng.permutation(nbs)]).astype(np.int32)
    pos = np.array([nbs * page - 1, 3000], np.int32)
    qi = (0.5 + np.abs(rng.standard_normal((B, 32, 128)))).astype(np.float32)
    wi = (np.abs(rng.standard_normal((B, 32))) * (32 * 128) ** -0.5).astype(np.float32)
    s_ref = index_scores_f64(qi, wi, np.asarray(fmt.dequantize(gather_pages(parts, bt))), pos)
    s = np.asarray(ipaged.kernel_scores(qi, wi, parts, bt, pos, fmt=fmt, backend="gpu"))
    _check(s, s_ref, STORAGE_BAR)
