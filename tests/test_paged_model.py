"""MLA on the paged, quantised cache (kimi_jax.modules.mla.PagedMLACache, kimi_jax.modules.decoder.PagedModelCache).

* Model level (tiny preset, bf16 latent + bf16 index keys): a batch of three sequences of different lengths, prefilled
  one row at a time in 64-token chunks into shuffled, non-contiguous pages, then decoded together step by step across
  page boundaries, gives the same logits as the contiguous reference cache (`ModelCache`, MLA rows stored bf16) fed
  the same tokens. The sequences are longer than the indexer's top-k (8), so selection really happens.
* Layer level (one MLA module, every storage format): the paged path — quantise-on-write at each row's own start,
  padding rows dropped, top-k over paged keys, sparse absorbed attention — equals the contiguous dense-mask path
  fed the same dequantised rows and keys (what the format stored), so quantisation changes no comparison: the only
  differences are float32 summation order. Without an indexer every position ≤ the query's is attended.

Shapes are few on purpose: each new one compiles the tiny model again (~20 s on 2 cores).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kimi_jax import quant as Q
from kimi_jax.cache import PAGE_TOKENS
from kimi_jax.config import get_preset
from kimi_jax.modules.decoder import ModelCache
from kimi_jax.modules.mla import MLACache, MultiHeadLatentAttention, PagedMLACache, _write_rows
from kimi_jax.paged_cache import NULL_BLOCK, BlockAllocator, LayerPool, PagedCacheSpec

MAX_LEN = 320  # 5 pages per sequence
PROMPT_LENS = (64, 128, 192)  # prefilled in 64-token chunks, one row at a time
DECODE_STEPS = 70  # then decoded together: 134 / 198 / 262 tokens, every row crosses a page boundary


def rel_rms(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b ** 2)))


def _run(model, cache, prompts, tokens_bt):
    """Prefill row b with prompts[b] (64-token chunks into `cache.take(b)`), insert it, then decode all rows together
    feeding tokens_bt[:, t] (fixed tokens, so both caches see identical inputs). Returns (logits list, cache)."""
    out = []
    for b, ids in enumerate(prompts):
        one = cache.take(b)
        for c in range(0, len(ids), PAGE_TOKENS):
            logits, one = model.prefill(np.asarray([ids[c: c + PAGE_TOKENS]]), cache=one)
            out.append(np.asarray(logits[0]))
        cache = cache.insert(b, one)
    for t in range(tokens_bt.shape[1]):
        logits, cache = model.decode_step(cache, tokens_bt[:, t])
        out.append(np.asarray(logits))
    return out, cache


@pytest.fixture(scope="module")
def traffic():
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 1000, n).tolist() for n in PROMPT_LENS]
    return prompts, rng.integers(0, 1000, (len(PROMPT_LENS), DECODE_STEPS)).astype(np.int32)


def test_paged_bf16_equals_contiguous_reference(tiny_model, traffic):
    prompts, tokens = traffic
    cfg = tiny_model.config
    B = len(prompts)
    # reference: contiguous rows, stored bf16 like the paged bf16 format
    ref = ModelCache.zeros(cfg, B, MAX_LEN, tiny_model.dtype)
    ref = ref._replace(layers=tuple(MLACache(*(a.astype(jnp.bfloat16) for a in c)) if isinstance(c, MLACache) else c
                                    for c in ref.layers))
    want, ref = _run(tiny_model, ref, prompts, tokens)

    # paged: 15 usable pages handed out in a shuffled order, rows' pages interleaved in the pool
    paged = tiny_model.new_paged_cache(B, MAX_LEN, num_blocks=16, kv_dtype="bf16", index_dtype="bf16")
    perm = iter(np.random.default_rng(1).permutation(np.arange(1, 16)))
    tables = np.zeros((B, MAX_LEN // PAGE_TOKENS), np.int32)
    final = [n + DECODE_STEPS for n in PROMPT_LENS]
    for j in range(tables.shape[1]):
        for b in range(B):
            if j * PAGE_TOKENS < final[b]:
                tables[b, j] = next(perm)
    assert sorted(tables[tables > 0].tolist()) != tables[tables > 0].tolist()  # not in order
    got, paged = _run(tiny_model, paged.with_block_tables(tables), prompts, tokens)

    assert max(PROMPT_LENS) > cfg.indexer.topk
    np.testing.assert_array_equal(np.asarray(paged.length), final)
    np.testing.assert_array_equal(np.asarray(ref.length), final)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=2e-4 * np.abs(w).max(), rtol=0)
    # the stored bf16 values are identical; only float32 summation order differs (online softmax over gathered
    # rows vs one dense masked softmax): ~1e-6 relative RMS per step, the odd step up to ~1e-4 (8.8e-5 on one x86
    # host with XLA CPU's jax 0.10.2, 2e-5 on another: the order differs by host), and no drift over 70 steps —
    # every spike is gone at the next step, and the last steps are as close as the first
    errs = [rel_rms(g, w) for g, w in zip(got, want)]
    assert np.median(errs) < 5e-6 and max(errs) < 2e-4 and np.median(errs[-20:]) < 5e-6, errs
    # writes never touched the null block or a page nobody owns
    used = set(tables[tables > 0].tolist())
    for c in paged.layers:
        if isinstance(c, LayerPool):
            rows = np.asarray(c.latent[0].astype(jnp.float32))
            for blk in range(16):
                assert (np.abs(rows[blk]).sum() > 0) == (blk in used), blk


def test_new_paged_cache_defaults(tiny_model):
    c = tiny_model.new_paged_cache(2, 100)  # 2 pages per row, pool sized for everyone, tables filled
    assert c.spec.num_blocks == 5 and c.max_len == 128 and c.spec.layout.index_dtype == "bf16"
    np.testing.assert_array_equal(np.asarray(c.block_tables), [[1, 2], [3, 4]])
    kinds = tiny_model.config.layer_kinds
    assert [type(x).__name__ for x in c.layers] == ["LayerPool" if k == "mla" else "KDACache" for k in kinds]
    q = tiny_model.new_paged_cache(1, 64, num_blocks=3, kv_dtype="nvfp4")
    assert q.spec.layout.index_dtype == "fp8" and (np.asarray(q.block_tables) == NULL_BLOCK).all()
    with pytest.raises(ValueError, match="block tables must be"):
        q.with_block_tables(np.zeros((2, 1), np.int32))


# ================================================================================================== layer level
def _config(index_dim=None, indexer=True):
    cfg = get_preset("tiny")
    if not indexer:
        return cfg.replace(indexer=None)
    return cfg.replace(indexer=dataclasses.replace(cfg.indexer, head_dim=index_dim or cfg.indexer.head_dim))


B, MAX_BLOCKS = 2, 3
CHUNKS = [  # (T, starts, lengths): a padded prefill chunk, one starting mid-page, then decode steps
    (48, (0, 0), (48, 30)),
    (48, (48, 30), (48, 48)),
] + [(1, (96 + i, 78 + i), (1, 1)) for i in range(4)]


@partial(jax.jit, static_argnums=(0,))
def _paged_call(graphdef, state, x, cache, start, lengths):
    m = nnx.merge(graphdef, state)
    return m(x, cache, start, lengths=lengths)


@partial(jax.jit, static_argnums=(0, 1, 2))
def _reference_call(graphdef, lat_fmt, idx_fmt, state, x, kv, keys, start, scale):
    """Contiguous dense-mask attention over rows / keys that went through the storage formats and back."""
    m = nnx.merge(graphdef, state)
    p = m.project(x, start)
    kv = _write_rows(kv, Q.round_trip(lat_fmt, p.row, scale), start)
    if idx_fmt is not None:
        keys = _write_rows(keys, Q.round_trip(idx_fmt, p.index_k), start)
    return m.output(x, m.attend_contiguous(x, p, kv, keys)), kv, keys


@pytest.mark.parametrize("kv,ix,index_dim", [("bf16", "bf16", None), ("fp8", "fp8", None),
                                              ("nvfp4", "mxfp4", 32), ("fp8", None, None)])
def test_layer_paged_equals_dequantised_contiguous(kv, ix, index_dim):
    cfg = _config(index_dim, indexer=ix is not None)
    mla = MultiHeadLatentAttention(cfg.hidden_size, cfg.mla, cfg.indexer, rngs=nnx.Rngs(3))
    graphdef, state = nnx.split(mla)
    spec = PagedCacheSpec.create(cfg, num_blocks=8, kv_dtype=kv, index_dtype=ix or "fp8")
    alloc = BlockAllocator.for_spec(spec)
    for seq, n in (("b", 64), ("a", 64), ("a", 100), ("b", 82)):  # interleaved pages: a = 2, 3; b = 1, 4
        alloc.allocate(seq, n)
    scale = 0.5  # a calibrated per-layer latent scale (ignored by bf16)
    cache = PagedMLACache(spec.init_layer(latent_scale=scale), jnp.asarray(alloc.block_table(["a", "b"], MAX_BLOCKS)),
                          spec)
    S = MAX_BLOCKS * PAGE_TOKENS
    kv_ref = jnp.zeros((B, S, cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim), jnp.float32)
    keys_ref = jnp.zeros((B, S, cfg.indexer.head_dim if cfg.indexer else 0), jnp.float32)
    rng = np.random.default_rng(4)
    for T, starts, lengths in CHUNKS:
        x = jnp.asarray(rng.standard_normal((B, T, cfg.hidden_size)), jnp.float32)
        starts, lengths = jnp.asarray(starts, jnp.int32), jnp.asarray(lengths, jnp.int32)
        got, cache = _paged_call(graphdef, state, x, cache, starts, lengths)
        want, kv_ref, keys_ref = _reference_call(graphdef, spec.latent_format, spec.index_format, state, x, kv_ref,
                                                 keys_ref, starts, jnp.float32(scale))
        real = np.arange(T)[None] < np.asarray(lengths)[:, None]
        g, w = np.asarray(got)[real], np.asarray(want)[real]
        assert rel_rms(g, w) < 1e-5, (kv, ix, T)
        np.testing.assert_allclose(g, w, atol=1e-5 * np.abs(w).max())
        assert (np.asarray(got)[~real] == 0).all()  # padding rows: nothing selected, zero output
    # padding rows were dropped: the pool holds exactly rows 0…len−1 of each sequence
    rows = spec.gather_latent(cache.pool, cache.block_tables, jnp.arange(S)[None].repeat(B, 0))
    want_rows = jnp.where((jnp.arange(S)[None, :, None] < jnp.asarray([[100], [82]])[..., None]), kv_ref, 0.0)
    np.testing.assert_array_equal(np.asarray(rows), np.asarray(want_rows))
    assert all(int(jnp.abs(p[NULL_BLOCK].astype(jnp.float32)).sum()) == 0 for p in cache.pool.latent)


@partial(jax.jit, static_argnums=(0, 1))
def _paged_call_ctx(graphdef, ctx, state, x, cache, start, lengths):
    m = nnx.merge(graphdef, state)
    return m(x, cache, start, lengths=lengths, ctx=ctx)


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_layer_without_indexer_at_storage_precision_stays_within_the_storage_bar(platform):
    """The MLA layer without an indexer (Kimi-Linear's), paged bf16 rows, bf16 activations: a 150-token prefill in
    two chunks (the second one starts mid-page) with the attention's products in bf16 (`dsa_precision="storage"`,
    what `--attention-precision auto` serves a bf16 model with) is within the storage formats' 5e-3 relative RMS of
    the exact products; as the engine runs it on a CPU and (lowered for) a GPU."""
    from sharding.context import ForwardContext, KernelConfig

    cfg = _config(indexer=False)
    mla = MultiHeadLatentAttention(cfg.hidden_size, cfg.mla, None, rngs=nnx.Rngs(5), dtype=jnp.bfloat16)
    graphdef, state = nnx.split(mla)
    spec = PagedCacheSpec.create(cfg, num_blocks=4, kv_dtype="bf16", index_dtype="fp8")
    x = jnp.asarray(np.random.default_rng(6).standard_normal((1, 150, cfg.hidden_size)), jnp.bfloat16)
    table = jnp.asarray([[1, 2, 3]], jnp.int32)
    out = {}
    for precision in ("exact", "storage"):
        ctx = ForwardContext(kernels=KernelConfig(dsa_precision=precision), platform=platform)
        cache = PagedMLACache(spec.init_layer(), table, spec)
        parts = []
        for start, n in ((0, 96), (96, 54)):
            got, cache = _paged_call_ctx(graphdef, ctx, state, x[:, start:start + n], cache,
                                         jnp.asarray([start], jnp.int32), jnp.asarray([n], jnp.int32))
            parts.append(np.asarray(got, np.float32))
        out[precision] = np.concatenate(parts, axis=1)
    err = rel_rms(out["storage"], out["exact"])
    assert 0 < err < 5e-3, err


def test_quantised_layer_output_error_vs_full_precision():
    """What latent quantisation itself costs at the layer output (150 tokens, fp32 rows as the reference). Measured
    without an indexer: with one, a quantised key can swap a near-tie in or out of the top-k, a discrete change that
    says nothing about the storage error (bf16 index keys alone move the output by ~6% relative RMS on this random
    layer). Bounds: bf16 (8-bit mantissa) 5e-3, fp8 e4m3 (3-bit mantissa, 2^-4 relative step) 5e-2, nvfp4 (e2m1
    with one E4M3 scale per 16 values) 1.5e-1 relative RMS."""
    cfg = _config(indexer=False)
    mla = MultiHeadLatentAttention(cfg.hidden_size, cfg.mla, None, rngs=nnx.Rngs(5))
    graphdef, state = nnx.split(mla)
    x = jnp.asarray(np.random.default_rng(6).standard_normal((1, 150, cfg.hidden_size)), jnp.float32)
    start, lengths = jnp.zeros((1,), jnp.int32), jnp.asarray([150], jnp.int32)
    table = jnp.asarray([[1, 2, 3]], jnp.int32)
    out = {}
    for kv in ("bf16", "fp8", "nvfp4"):
        spec = PagedCacheSpec.create(cfg, num_blocks=4, kv_dtype=kv)
        out[kv], _ = _paged_call(graphdef, state, x, PagedMLACache(spec.init_layer(), table, spec), start, lengths)
    full, _ = nnx.merge(graphdef, state)(x, None, 0)
    errs = {kv: rel_rms(out[kv], full) for kv in out}
    print("relative RMS error vs fp32 rows:", errs)
    assert errs["bf16"] < 5e-3 and errs["fp8"] < 5e-2 and errs["nvfp4"] < 1.5e-1, errs
