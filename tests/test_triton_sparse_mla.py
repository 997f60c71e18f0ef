"""The GPU sparse MLA decode kernel (native Triton, `pallas_kernels.mla.sparse_gpu_triton`) against its reference
(`sparse.decode(..., backend="reference")` on the dequantised rows).

CPU: Triton's interpreter (backend "gpu_interpret"; tests/conftest.py sets TRITON_INTERPRET=1) on the small
geometry of tests/test_dsa_kernels.py (latent 64 + rope 16, 4 heads, k = 40), at its bars: exact mode 1e-4 relative
RMS of o and lse (fp32-level products through the hi/lo planes), single-pass settings and the storage presets 5e-3.
`gpu`-marked tests run the kernel through jax-triton on a device:
`JAX_PLATFORMS=cuda python -m pytest tests/test_triton_sparse_mla.py -m gpu`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("triton")
pytest.importorskip("torch")

from test_dsa_kernels import (  # noqa: E402  (the shared small geometry and helpers)
    BT, SMALL_BT, SMALL_POS, STORAGE_BAR, _big_pool, _small, mla_case, rel_rms)

from kimi_jax import quant as Q  # noqa: E402
from pallas_kernels.mla import sparse, sparse_gpu_triton  # noqa: E402

NATIVE = "gpu_interpret"


def _decode(q, parts, bt, idx, kernel_kw, backend=NATIVE, **kw):
    return sparse.decode(q, parts, bt, idx, backend=backend, kernel_kw=kernel_kw, **kw)


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8", "nvfp4"])
def test_triton_sparse_mla_matches_reference_on_dequantised_rows(kv_dtype):
    """3 key blocks of 16 over 2 splits (the second padded with empty slots) merged on the lse; an empty slot."""
    parts, idx, q, kw = mla_case(kv_dtype)
    idx[0, 5] = -1
    o_r, lse_r = sparse.decode(q, parts, BT, idx, backend="reference", **kw)
    o, lse = _decode(q, parts, BT, idx, dict(block_k=16, splits=2), **kw)
    assert o.shape == o_r.shape and lse.shape == lse_r.shape
    assert rel_rms(o, o_r) <= 1e-4 and rel_rms(lse, lse_r) <= 1e-4


def test_triton_sparse_mla_fast_mode_and_empty_rows():
    parts, idx, q, kw = mla_case("fp8", seed=4)
    idx[2] = -1  # a sequence with no selected key: o = 0, lse = −inf
    o_r, lse_r = sparse.decode(q, parts, BT, idx, backend="reference", **kw)
    o, lse = map(np.asarray, _decode(q, parts, BT, idx, dict(block_k=16, exact=False), **kw))
    assert (o[2] == 0).all() and (lse[2] == -np.inf).all()
    assert rel_rms(o[:2], np.asarray(o_r)[:2]) <= STORAGE_BAR
    np.testing.assert_allclose(lse[:2], np.asarray(lse_r)[:2], rtol=STORAGE_BAR)


@pytest.mark.parametrize("kv_dtype,kw", [("fp8", dict(dot_dtype="bf16")), ("nvfp4", dict(dot_dtype="f16")),
                                         ("fp8", dict(block_h=32, num_warps=8)),
                                         ("fp8", dict(slots_outside=True, value_reload=True, merge="triton",
                                                      splits=2)),
                                         ("nvfp4", dict(slots_outside=True, value_reload=True, block_v=16))])
def test_triton_sparse_mla_knobs_and_garbage_indices(kv_dtype, kw):
    parts, idx, q, kw_ = mla_case(kv_dtype, seed=7)
    q = q * 100.0  # large q: the per-head power-of-two normalisation keeps the f16 halves in range
    o_r, lse_r = sparse.decode(q, parts, BT, idx, backend="reference", **kw_)
    o, lse = _decode(q, parts, BT, idx, dict(block_k=16, **kw), **kw_)
    assert rel_rms(o, o_r) <= 1e-4 and rel_rms(lse, lse_r) <= 1e-4
    bt = BT.copy()
    bt[1, 2:] = [10**6, -3]  # pages sequence 1 never selects: garbage must not matter
    o2, _ = _decode(q, parts, bt, idx, dict(block_k=16, **kw), **kw_)
    np.testing.assert_array_equal(np.asarray(o2), np.asarray(o))


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8", "nvfp4"])
@pytest.mark.parametrize("preset", ["storage_small_h", "wide128_v256", "wide64"])
def test_triton_sparse_mla_storage_presets_meet_the_storage_bar(kv_dtype, preset):
    """The presets `precision="storage"` takes (≤ 16 heads: q prepared in the kernel, pool rows outside, a second
    load for the PV rows; more heads: all heads in one program, value halves) with 2 splits merged by the merge
    kernel and an empty slot, at the storage bar."""
    parts, idx, q, kw = mla_case(kv_dtype, seed=21)
    idx[0, 5] = -1
    idx[2, 30:] = -1
    o_r, lse_r = sparse.decode(q, parts, BT, idx, backend="reference", **kw)
    settings = sparse_gpu_triton.storage_preset(8, 4) if preset == "storage_small_h" else sparse_gpu_triton.WIDE[preset]
    o, lse = _decode(q, parts, BT, idx, dict(_small(settings), block_k=16, splits=2), **kw)
    assert rel_rms(o, o_r) <= STORAGE_BAR and rel_rms(lse, lse_r) <= STORAGE_BAR


def test_triton_sparse_mla_precision_storage_takes_the_preset():
    parts, idx, q, kw = mla_case("fp8", seed=22)
    o_r, lse_r = sparse.decode(q, parts, BT, idx, backend="reference", **kw)
    o, lse = sparse.sparse_mla(q[:, None], parts, BT, idx[:, None], backend=NATIVE, precision="storage", **kw)
    assert rel_rms(o[:, 0], o_r) <= STORAGE_BAR and rel_rms(lse[:, 0], lse_r) <= STORAGE_BAR


@pytest.mark.parametrize("backend", [NATIVE, pytest.param("gpu", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("kw", [{}, dict(sparse_gpu_triton.storage_preset(8, 2))])
def test_triton_sparse_mla_pads_a_short_selection(backend, kw):
    """The tiny model's shapes (latent 32 + rope 16, 2 heads, k = 8): head block and key block padded to 16 (on
    the H200 dots with a side < 16 gave wrong results before the wrapper padded them)."""
    parts, idx, q, mkw = mla_case("fp8", seed=22, B=2, k=8, bt=SMALL_BT, pos=SMALL_POS, nb=5, page=64, r=32,
                                  rope=16, h=2)
    o_r, lse_r = sparse.decode(q, parts, SMALL_BT, idx, backend="reference", **mkw)
    o, lse = _decode(q, parts, SMALL_BT, idx, kw or None, backend=backend, **mkw)
    bound = 1e-4 if kw.get("exact", True) else STORAGE_BAR
    assert rel_rms(o, o_r) <= bound and rel_rms(lse, lse_r) <= bound


# ------------------------------------------------------------------------------------------------ device

def _gpu_case(kv_dtype, heads, **kernel_kw):
    rng = np.random.default_rng(12)
    B, nbs, page = 3, 64, 64  # 4K tokens per sequence, K3.1's latent (512 + 64), top-2048
    nb, bt = _big_pool(rng, B, nbs)
    pos = np.array([4095, 3000, 1000], np.int32)  # the last one has fewer than k keys
    parts, idx, q, kw = mla_case(kv_dtype, seed=13, B=B, k=2048, bt=bt, pos=pos, nb=nb, page=page, r=512, rope=64,
                                 h=heads)
    kw["scale"] = 192 ** -0.5
    o_r, lse_r = sparse.decode(q, parts, bt, idx, backend="reference", **kw)
    o, lse = sparse.decode(q, parts, bt, idx, backend="gpu", kernel_kw=dict(kernel_kw, impl="triton"), **kw)
    return rel_rms(o, o_r), rel_rms(lse, lse_r)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8", "nvfp4"])
@pytest.mark.parametrize("heads", [96, 12])
def test_gpu_triton_sparse_mla_exact_and_storage_presets(kv_dtype, heads):
    e_o, e_lse = _gpu_case(kv_dtype, heads)
    assert e_o <= 1e-4 and e_lse <= 1e-4, f"hi/lo q split lost on the device? rel rms {e_o:.2e} / {e_lse:.2e}"
    e_o, e_lse = _gpu_case(kv_dtype, heads, **sparse_gpu_triton.storage_preset(8, heads))
    assert e_o <= STORAGE_BAR and e_lse <= STORAGE_BAR


@pytest.mark.gpu
def test_gpu_triton_sparse_mla_addresses_the_top_of_a_pool_over_2gib():
    """fp8 latent pool of 65,600 pages × 64 × 576 B = 2.42 GB, sequences in its top pages: int64 row addressing."""
    rng = np.random.default_rng(20)
    page, nbs, B, H, k = 64, 32, 2, 16, 512
    fmt = Q.LatentFormat("fp8", 512, 64)
    nb = 65600
    bits = jax.random.bits(jax.random.PRNGKey(0), (nb, page, fmt.width), jnp.uint8) & jnp.uint8(0xBF)
    parts = (jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn),)
    del bits
    bt = np.stack([nb - 1 - np.arange(nbs), nb - 1 - nbs - rng.permutation(nbs)]).astype(np.int32)
    idx = np.stack([rng.permutation(nbs * page)[:k] for _ in range(B)]).astype(np.int32)
    q = rng.standard_normal((B, H, fmt.width)).astype(np.float32)
    kw = dict(fmt=fmt, layer_scale=jnp.float32(0.5), scale=192 ** -0.5, value_dim=512)
    o_r, lse_r = sparse.decode(q, parts, bt, idx, backend="reference", **kw)
    o, lse = sparse.decode(q, parts, bt, idx, backend="gpu", kernel_kw=dict(impl="triton"), **kw)
    assert rel_rms(o, o_r) <= 1e-4 and rel_rms(lse, lse_r) <= 1e-4


def test_triton_sparse_mla_fits():
    assert sparse_gpu_triton.fits(Q.LatentFormat("nvfp4", 512, 64))
    assert not sparse_gpu_triton.fits(Q.LatentFormat("fp8", 32, 8))
