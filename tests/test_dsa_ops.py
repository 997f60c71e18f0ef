"""DSA ops over the paged cache: the indexer's top-k (pallas_kernels.indexer.paged) and sparse MLA
(pallas_kernels.mla.sparse, and its TPU kernel in interpret mode), against the dense references."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimi_jax import quant as Q
from kimi_jax.config import get_preset
from kimi_jax.paged_cache import BlockAllocator, PagedCacheSpec
from pallas_kernels.indexer import paged as ipaged
from pallas_kernels.indexer import reference as iref
from pallas_kernels.mla import reference as mref
from pallas_kernels.mla import sparse

R, ROPE, C, H, DI, HI = 32, 8, 40, 4, 32, 2
# the same geometry as tests/test_paged_cache.py (8-block pools, two sequences padded to 152 rows), so compiled
# programs are shared when both files run in one session
LENS = (150, 70)  # two sequences, pages interleaved in the pool
T_PAD = 152
SCALE = 0.3


def rel_rms(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b ** 2)))


# NOTE: pallas_kernels.mla.reference.absorbed returns NaN (not the documented zeros) for a query with no allowed key
# on CPU: its `jnp.maximum(denom, 1e-38)` guard is a float32 subnormal that XLA flushes to zero. Comparisons against
# it therefore use only the real (non-padding) query rows; the sparse op's own empty rows are checked to be 0 / −inf.
absorbed = jax.jit(mref.absorbed, static_argnums=(3, 4))
scores = jax.jit(iref.scores)
topk_mask = jax.jit(iref.topk_mask, static_argnums=2)


def small_config():
    cfg = get_preset("tiny")
    return cfg.replace(indexer=dataclasses.replace(cfg.indexer, head_dim=DI))


def filled_pool(kv="fp8", ix="fp8", seed=0, keys=None):
    """Two sequences (150 and 70 tokens) written into one layer pool; returns spec, pool, block tables, raw data."""
    spec = PagedCacheSpec.create(small_config(), num_blocks=8, kv_dtype=kv, index_dtype=ix)
    alloc = BlockAllocator.for_spec(spec)
    for seq, n in (("a", 64), ("b", 64), ("a", 150), ("b", 70)):  # a: blocks 1, 3, 4   b: 2, 5
        alloc.allocate(seq, n)
    bt = alloc.block_table(["a", "b"], max_blocks=3)
    rng = np.random.default_rng(seed)
    rows = rng.standard_normal((2, T_PAD, C)).astype(np.float32)
    if keys is None:
        keys = rng.standard_normal((2, T_PAD, DI)).astype(np.float32)
    pool = spec.write(spec.init_layer(latent_scale=0.5), bt, np.zeros(2, np.int32), rows, keys, np.array(LENS))
    return spec, pool, bt, rows, keys


def query_positions():
    t = np.arange(T_PAD)[None].repeat(2, 0)
    return np.where(t < np.array(LENS)[:, None], t, -1).astype(np.int32)


# ------------------------------------------------------------------------------------------------ indexer

def test_pool_block_tables_are_interleaved():
    _, _, bt, _, _ = filled_pool()
    np.testing.assert_array_equal(bt, [[1, 3, 4], [2, 5, 0]])


@pytest.mark.parametrize("kv,ix", [("fp8", "fp8"), ("nvfp4", "mxfp4")])
def test_indexer_prefill_selects_the_reference_top_k(kv, ix):
    rng = np.random.default_rng(1)
    # q·k > 0 almost surely (no relu zeros), so scores are untied
    keys = (1.0 + 0.5 * rng.standard_normal((2, T_PAD, DI))).astype(np.float32)
    spec, pool, bt, _, _ = filled_pool(kv=kv, ix=ix, keys=keys)
    q = (0.5 + np.abs(rng.standard_normal((2, T_PAD, HI, DI)))).astype(np.float32)
    w = np.abs(rng.standard_normal((2, T_PAD, HI))).astype(np.float32) * (HI * DI) ** -0.5
    topk = 16
    idx = ipaged.prefill(q, w, pool.index, bt, np.zeros(2), topk, fmt=spec.index_format, lengths=np.array(LENS))
    assert idx.shape == (2, T_PAD, topk) and idx.dtype == jnp.int32
    # the reference on the dequantised keys, laid out by position
    keys = np.asarray(spec.gather_index_keys(pool, bt))[:, :T_PAD]
    pos = query_positions()
    allowed = np.arange(T_PAD)[None, None, :] <= pos[:, :, None]
    s = np.asarray(scores(q, keys, w, allowed))
    want = np.asarray(topk_mask(s, allowed, topk))
    # untied at the cut: the k-th best score beats the (k+1)-th for every row that has more than k keys
    srt = -np.sort(-np.where(allowed, s, -np.inf), axis=-1)
    full = allowed.sum(-1) > topk
    assert full.sum() > 150 and np.all(srt[..., topk - 1][full] > srt[..., topk][full])
    np.testing.assert_array_equal(np.asarray(ipaged.indices_to_mask(idx, T_PAD)), want)
    # chunked prefill (score buffer bounded to 4 query rows) selects the same
    bound = 4 * 2 * HI * 3 * 64 * 4
    assert ipaged.query_chunk(2, HI, 3 * 64, T_PAD, bound) == 4
    idx_c = ipaged.prefill(q, w, pool.index, bt, np.zeros(2), topk, fmt=spec.index_format, lengths=np.array(LENS),
                           max_score_bytes=bound)
    np.testing.assert_array_equal(np.asarray(idx_c), np.asarray(idx))
    # decode at the last position of each sequence = that prefill row
    last = np.array(LENS) - 1
    dec = ipaged.decode(q[[0, 1], last], w[[0, 1], last], pool.index, bt, np.array(LENS), topk, fmt=spec.index_format)
    np.testing.assert_array_equal(np.sort(np.asarray(dec), -1), np.sort(np.asarray(idx)[[0, 1], last], -1))


def test_indexer_tie_rule_earlier_position_wins():
    same = np.ones((2, T_PAD, DI), np.float32)  # every key equal -> every score of a row equal
    spec, pool, bt, _, _ = filled_pool(ix="fp8", keys=same)
    q = np.ones((2, T_PAD, HI, DI), np.float32)
    w = np.ones((2, T_PAD, HI), np.float32)
    idx = np.asarray(ipaged.prefill(q, w, pool.index, bt, np.zeros(2), 16, fmt=spec.index_format,
                                    lengths=np.array(LENS)))
    np.testing.assert_array_equal(idx[0, 100], np.arange(16))
    np.testing.assert_array_equal(idx[1, 69], np.arange(16))
    np.testing.assert_array_equal(idx[0, 5], list(range(6)) + [-1] * 10)  # fewer than k allowed: all, then −1
    assert (idx[1, 70:] == -1).all()  # padding queries select nothing


def test_indexer_short_sequences_keep_every_allowed_key():
    spec, pool, bt, _, _ = filled_pool(ix="fp8")
    rng = np.random.default_rng(2)
    q = rng.standard_normal((2, T_PAD, HI, DI)).astype(np.float32)
    w = rng.standard_normal((2, T_PAD, HI)).astype(np.float32)
    topk = 256  # more than the 192 cached slots: the buffer is padded, every allowed key is kept
    idx = np.asarray(ipaged.prefill(q, w, pool.index, bt, np.zeros(2), topk, fmt=spec.index_format,
                                    lengths=np.array(LENS)))
    pos = query_positions()
    mask = np.asarray(ipaged.indices_to_mask(idx, T_PAD))
    np.testing.assert_array_equal(mask, np.arange(T_PAD)[None, None, :] <= pos[:, :, None])
    assert ((idx >= 0).sum(-1) == pos + 1).all()


# ------------------------------------------------------------------------------------------------ sparse MLA

def causal_indices(S, k):
    """Every position ≤ t (shorter than k): [S, k] with −1 padding."""
    t = np.arange(S)[:, None]
    j = np.arange(k)[None, :]
    return np.where(j <= t, j, -1).astype(np.int32)


def random_indices(rng, pos, k, n_keys):
    """For each query position, k distinct allowed positions (all of them, −1-padded, when fewer)."""
    out = np.full(pos.shape + (k,), -1, np.int32)
    for i in np.ndindex(pos.shape):
        if pos[i] < 0:
            continue
        cand = rng.permutation(pos[i] + 1)[:k]
        out[i][: len(cand)] = cand
    return out


def test_sparse_fp32_equals_dense_causal_attention_when_shorter_than_k():
    rng = np.random.default_rng(3)
    S, k = 40, 48
    kv = rng.standard_normal((2, S, C)).astype(np.float32)
    q = rng.standard_normal((2, S, H, C)).astype(np.float32)
    idx = np.broadcast_to(causal_indices(S, k), (2, S, k))
    o, lse = sparse.sparse_absorbed_dense(q, kv, idx, scale=SCALE, value_dim=R, block_k=8)
    causal = np.broadcast_to(np.tril(np.ones((S, S), bool)), (2, S, S))
    o_ref, lse_ref = absorbed(q, kv, causal, SCALE, R)
    assert rel_rms(o, o_ref) <= 1e-4 and rel_rms(lse, lse_ref) <= 1e-4


def test_sparse_fp32_gather_equals_additive_mask_and_chunks_agree():
    rng = np.random.default_rng(4)
    S, k = 40, 16
    kv = rng.standard_normal((2, S, C)).astype(np.float32)
    q = rng.standard_normal((2, S, H, C)).astype(np.float32)
    pos = np.arange(S)[None].repeat(2, 0)
    pos[1, 30:] = -1  # padding queries
    idx = random_indices(rng, pos, k, S)
    o, lse = sparse.sparse_absorbed_dense(q, kv, idx, scale=SCALE, value_dim=R, block_k=8)
    mask = np.asarray(ipaged.indices_to_mask(idx, S))
    o_ref, lse_ref = absorbed(q, kv, mask, SCALE, R)
    ok = pos >= 0
    assert rel_rms(np.asarray(o)[ok], np.asarray(o_ref)[ok]) <= 1e-4
    np.testing.assert_allclose(np.asarray(lse)[ok], np.asarray(lse_ref)[ok], rtol=1e-5)
    assert np.all(np.asarray(o)[1, 30:] == 0) and np.all(np.asarray(lse)[1, 30:] == -np.inf)
    o_c, lse_c = sparse.sparse_absorbed_dense(q, kv, idx, scale=SCALE, value_dim=R, block_k=8, q_chunk=7)
    np.testing.assert_allclose(np.asarray(o_c), np.asarray(o), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(lse_c) == -np.inf, np.asarray(lse) == -np.inf)


def _paged_case(kv, seed=5, k=16):
    spec, pool, bt, _, _ = filled_pool(kv=kv, seed=seed)
    rng = np.random.default_rng(seed + 100)
    pos = query_positions()
    idx = random_indices(rng, pos, k, T_PAD)
    q = rng.standard_normal((2, T_PAD, H, C)).astype(np.float32)
    dense = np.asarray(spec.gather_latent(pool, bt, np.broadcast_to(np.arange(T_PAD), (2, T_PAD))))
    return spec, pool, bt, idx, q, dense, pos


@pytest.mark.parametrize("kv", ["fp8", "nvfp4"])  # bf16 rows: the TPU-kernel test below
def test_sparse_paged_prefill_matches_reference_on_dequantised_rows(kv):
    spec, pool, bt, idx, q, dense, pos = _paged_case(kv)
    o, lse = sparse.prefill(q, pool.latent, bt, idx, fmt=spec.latent_format, layer_scale=pool.latent_scale,
                            scale=SCALE, value_dim=R, block_k=8)
    mask = np.asarray(ipaged.indices_to_mask(idx, T_PAD))
    o_ref, lse_ref = absorbed(q, dense, mask, SCALE, R)
    ok = pos >= 0
    assert rel_rms(np.asarray(o)[ok], np.asarray(o_ref)[ok]) <= 5e-3
    assert np.all(np.asarray(o)[~ok] == 0) and np.all(np.asarray(lse)[~ok] == -np.inf)
    assert rel_rms(np.asarray(lse)[ok], np.asarray(lse_ref)[ok]) <= 5e-3
    # decode: the last query of each sequence alone
    last = np.array(LENS) - 1
    o_d, lse_d = sparse.decode(q[[0, 1], last], pool.latent, bt, idx[[0, 1], last], fmt=spec.latent_format,
                               layer_scale=pool.latent_scale, scale=SCALE, value_dim=R, block_k=8)
    np.testing.assert_allclose(np.asarray(o_d), np.asarray(o)[[0, 1], last], rtol=1e-5, atol=1e-6)


def test_merging_partials_over_disjoint_key_sets_equals_the_whole():
    spec, pool, bt, idx, q, _, pos = _paged_case("fp8", seed=6)
    kw = dict(fmt=spec.latent_format, layer_scale=pool.latent_scale, scale=SCALE, value_dim=R, block_k=8)
    o, lse = sparse.prefill(q, pool.latent, bt, idx, **kw)
    halves = [np.where(np.arange(idx.shape[-1]) % 2 == p, idx, -1) for p in (0, 1)]  # disjoint slots
    parts = [sparse.prefill(q, pool.latent, bt, h, **kw) for h in halves]
    o_m, lse_m = mref.merge_partials(jnp.stack([p[0] for p in parts]), jnp.stack([p[1] for p in parts]))
    ok = pos >= 0
    assert rel_rms(np.asarray(o_m)[ok], np.asarray(o)[ok]) <= 1e-5
    np.testing.assert_allclose(np.asarray(lse_m)[ok], np.asarray(lse)[ok], rtol=1e-5)


def test_indexer_then_sparse_mla_equals_masked_dense_attention():
    """End to end over the paged cache: selected indices as a gather == the reference top-k as a mask."""
    spec, pool, bt, _, _ = filled_pool(kv="nvfp4", ix="mxfp4", seed=7)
    rng = np.random.default_rng(8)
    qi = rng.standard_normal((2, T_PAD, HI, DI)).astype(np.float32)
    w = rng.standard_normal((2, T_PAD, HI)).astype(np.float32)
    q = rng.standard_normal((2, T_PAD, H, C)).astype(np.float32)
    idx = ipaged.prefill(qi, w, pool.index, bt, np.zeros(2), 16, fmt=spec.index_format, lengths=np.array(LENS))
    o, _ = sparse.prefill(q, pool.latent, bt, idx, fmt=spec.latent_format, layer_scale=pool.latent_scale,
                          scale=SCALE, value_dim=R, block_k=8)
    pos = query_positions()
    allowed = np.arange(T_PAD)[None, None, :] <= pos[:, :, None]
    keys = np.asarray(spec.gather_index_keys(pool, bt))[:, :T_PAD]
    mask = topk_mask(scores(qi, keys, w, allowed), allowed, 16)
    dense = spec.gather_latent(pool, bt, np.broadcast_to(np.arange(T_PAD), (2, T_PAD)))
    o_ref, _ = absorbed(q, dense, mask, SCALE, R)
    ok = pos >= 0
    assert rel_rms(np.asarray(o)[ok], np.asarray(o_ref)[ok]) <= 5e-3


@pytest.mark.parametrize("kv", ["fp8", "bf16"])
def test_tpu_decode_kernel_in_interpret_mode_matches_reference(kv):
    spec, pool, bt, idx, q, _, _ = _paged_case(kv, seed=9)
    last = np.array(LENS) - 1
    qd, idd = q[[0, 1], last], idx[[0, 1], last]
    idd[1, 3] = -1  # an empty slot inside the first block
    kw = dict(fmt=spec.latent_format, layer_scale=pool.latent_scale, scale=SCALE, value_dim=R, block_k=8)
    o_k, lse_k = sparse.decode(qd, pool.latent, bt, idd, backend="interpret", **kw)  # 2 key blocks of 8
    o_r, lse_r = sparse.decode(qd, pool.latent, bt, idd, backend="reference", **kw)
    assert rel_rms(o_k, o_r) <= 1e-5
    np.testing.assert_allclose(np.asarray(lse_k), np.asarray(lse_r), rtol=1e-5)


@pytest.mark.parametrize("backend", ["reference", "tpu_interpret", "gpu_interpret"])
def test_sparse_decode_with_an_empty_selection_gives_zeros_and_minus_inf(backend):
    """k = 0 selected keys (idx `[B, 0]`) is a query with no key: o = 0 and lse = −inf, as the docstring says for
    all-empty slots (the TPU kernel returned NaN, the GPU kernel could not slice the empty index array)."""
    fmt = Q.LatentFormat("fp8", 64, 16)
    parts = fmt.quantize(jnp.asarray(np.random.default_rng(3).standard_normal((4, 16, 80)), jnp.float32), 0.5)
    o, lse = sparse.decode(jnp.ones((2, 3, 80)), parts, np.array([[1], [2]]), jnp.zeros((2, 0), jnp.int32),
                           fmt=fmt, layer_scale=0.5, scale=SCALE, value_dim=64, backend=backend)
    assert o.shape == (2, 3, 64) and lse.shape == (2, 3)
    assert (np.asarray(o) == 0).all() and (np.asarray(lse) == -np.inf).all()


def test_backend_choice_and_errors():
    assert sparse._pick_backend("auto", Q.LatentFormat("fp8", R, ROPE), 1) == "reference"  # CPU
    with pytest.raises(ValueError, match="unknown sparse MLA backend"):
        sparse._pick_backend("cuda", None, 1)
    with pytest.raises(ValueError, match="decode-only"):
        sparse.sparse_mla(np.zeros((1, 2, H, C), np.float32), (np.zeros((2, 64, C), np.float32),),
                          np.zeros((1, 1), np.int32), np.zeros((1, 2, 4), np.int32), fmt=Q.LatentFormat("fp8", R, ROPE),
                          scale=SCALE, value_dim=R, backend="interpret")
