"""SPEC §6, "FP8 scoring as deployed: optional Hadamard rotation of both q and k (rotate both or neither), then FP8
e4m3 with one scale per 128 values … Whether K3.1 rotates is (unverified): make it a switch."

The switch is `IndexerConfig.hadamard_rotate`. Checked here against float64 NumPy written from that text:
- on: the index keys (what the cache stores) are H·k / sqrt(d) with H the Sylvester Hadamard matrix, and every index
  query head is H·q / sqrt(d) — both rotated, never one alone;
- on, FP8 index-key cache: the stored key is the e4m3 rounding of the ROTATED key with scale = max(amax, 1e-4) / 448
  rounded up to a power of two;
- since the rotation is orthonormal and applied to both sides, unquantised scores (hence the model's logits) do not
  change when the switch is turned on.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from kimi_jax.config import get_preset
from kimi_jax.model import Model
from kimi_jax.modules.decoder import KimiForCausalLM


def sylvester(n: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def layernorm64(x, w, b, eps):
    x = np.asarray(x, np.float64)
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * w + b


def _models():
    base = get_preset("tiny")
    rot = base.replace(indexer=dataclasses.replace(base.indexer, hadamard_rotate=True))
    build = lambda cfg: KimiForCausalLM(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32)
    return base, build(base), rot, build(rot)


def test_hadamard_switch_rotates_both_index_queries_and_keys():
    base, plain, rot, rotated = _models()
    layer = base.mla_layers[0]
    ix = rotated.layers[layer].self_attn.indexer
    d, Hi = rot.indexer.head_dim, rot.indexer.num_heads
    Hd = sylvester(d) / np.sqrt(d)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1, 5, base.hidden_size)).astype(np.float32)
    cq = rng.normal(size=(1, 5, base.mla.q_lora_rank)).astype(np.float32)

    wk = np.asarray(ix.wk.kernel[...], np.float64)
    k_ref = layernorm64(x[0] @ wk, np.asarray(ix.k_norm.weight[...], np.float64),
                        np.asarray(ix.k_norm.bias[...], np.float64), rot.indexer.norm_eps) @ Hd.T
    np.testing.assert_allclose(np.asarray(ix.keys(jnp.asarray(x), None))[0], k_ref, rtol=1e-5, atol=1e-5)

    q_ref = (cq[0] @ np.asarray(ix.wq_b.kernel[...], np.float64)).reshape(5, Hi, d) @ Hd.T
    q, w = ix.queries(jnp.asarray(x), jnp.asarray(cq), None)
    np.testing.assert_allclose(np.asarray(q)[0], q_ref, rtol=1e-5, atol=1e-5)
    w_ref = x[0] @ np.asarray(ix.weights_proj.kernel[...], np.float64) * Hi ** -0.5 * d ** -0.5
    np.testing.assert_allclose(np.asarray(w)[0], w_ref, rtol=1e-5, atol=1e-6)

    # the switch off: no rotation
    ix0 = plain.layers[layer].self_attn.indexer
    np.testing.assert_allclose(np.asarray(ix0.keys(jnp.asarray(x), None))[0], k_ref @ Hd, rtol=1e-5, atol=1e-5)


def test_hadamard_switch_fp8_index_cache_stores_rotated_keys():
    """What a prefill writes into an FP8 index-key page: e4m3(H·k/sqrt(d) / sc), sc = pow2ceil(max(amax,1e-4)/448)."""
    base, _, rot, rotated = _models()
    layer = base.mla_layers[0]
    attn = rotated.layers[layer].self_attn
    ix = attn.indexer
    d = rot.indexer.head_dim
    model = Model(rotated, dtype=jnp.float32)
    T = 6
    ids = np.random.default_rng(1).integers(0, base.vocab_size, (1, T))
    cache = model.new_paged_cache(1, 64, kv_dtype="fp8", index_dtype="fp8")
    _, cache = model.prefill(ids, cache=cache)
    page = int(np.asarray(cache.block_tables)[0, 0])
    codes, scales = (np.asarray(a[page, :T]) for a in cache.layers[layer].index)

    # the layer's input x, from the model's own float32 forward up to this layer's input_layernorm
    captured = {}
    orig = type(attn).__call__

    def spy(self, x_btd, *a, **k):
        if self is attn:
            captured["x"] = np.asarray(x_btd, np.float64)[0]
        return orig(self, x_btd, *a, **k)

    type(attn).__call__ = spy
    try:
        rotated(jnp.asarray(ids))
    finally:
        type(attn).__call__ = orig
    x = captured["x"]
    k = layernorm64(x @ np.asarray(ix.wk.kernel[...], np.float64), np.asarray(ix.k_norm.weight[...], np.float64),
                    np.asarray(ix.k_norm.bias[...], np.float64), rot.indexer.norm_eps)
    k_rot = k @ (sylvester(d) / np.sqrt(d)).T
    sc = 2.0 ** np.ceil(np.log2(np.maximum(np.abs(k_rot).max(-1), 1e-4) / 448.0))
    np.testing.assert_allclose(scales[:, 0], sc, rtol=0)
    want = np.clip(k_rot / sc[:, None], -448, 448).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
    got = codes.astype(np.float32)
    # equal codes, up to a float32-rounding flip at an exact e4m3 midpoint
    assert np.mean(got == want.astype(np.float32)) > 0.97
    np.testing.assert_allclose(got, want.astype(np.float32), rtol=2 ** -3, atol=2 ** -9)


def test_hadamard_switch_keeps_unquantised_logits():
    base, plain, _, rotated = _models()
    ids = jnp.asarray(np.random.default_rng(2).integers(0, base.vocab_size, (1, 20)))  # 20 > topk 8: selection runs
    a, _ = plain(ids)
    b, _ = rotated(ids)
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-4)
