"""Model-level checks of the tiny K3.1 model (`load_model("tiny")`, every feature on) against a float64 NumPy forward
assembled from np_reference functions (kda_layer, mla_with_indexer, mlp / moe, attn_res_forward, final norm, lm_head)
on the converted weights (weights_np.tiny_numpy_weights).

Compile budget: every distinct input shape of the tiny model is an XLA compile, so this file uses exactly
  * logits  [2, 20]  (absorbed and naive MLA forms),
  * logits  [1, 70],
  * prefill [1, 66] into a 70-token cache, and decode steps on that cache (shared by generate()).
T = 20 > indexer top-k (8): the DSA selection is sparse; T = 70 > 64: KDA prefill runs two chunks.
"""

from __future__ import annotations

import numpy as np
import pytest

import np_reference as ref
from weights_np import numpy_forward

VOCAB = 1024


@pytest.fixture(scope="module")
def ids_2x20():
    return np.random.default_rng(100).integers(0, VOCAB, (2, 20))


@pytest.fixture(scope="module")
def ids_1x70():
    return np.random.default_rng(101).integers(0, VOCAB, (1, 70))


@pytest.fixture(scope="module")
def logits_2x20(tiny_model, ids_2x20):
    return tiny_model.logits(ids_2x20)


@pytest.fixture(scope="module")
def logits_1x70(tiny_model, ids_1x70):
    return tiny_model.logits(ids_1x70)


def _check_vs_numpy(logits, ids, weights):
    ref_logits = np.stack([numpy_forward(weights, ids[b], ref) for b in range(ids.shape[0])])
    assert logits.shape == ref_logits.shape and logits.dtype == np.float32
    assert np.all(np.isfinite(logits))
    scale = ref_logits.std()
    err = np.abs(logits - ref_logits).max()
    assert err <= 1e-3 * scale, f"max abs diff {err:.3e} vs logit std {scale:.3e}"
    np.testing.assert_array_equal(logits.argmax(-1), ref_logits.argmax(-1))
    return ref_logits


def test_tiny_config_exercises_every_feature(tiny_model, tiny_np_weights):
    cfg = tiny_model.config
    kinds = [lw["kind"] for lw in tiny_np_weights["layers"]]
    assert kinds == list(cfg.layer_kinds) and "kda" in kinds and "mla" in kinds
    assert cfg.indexer is not None and cfg.indexer.topk == 8
    assert cfg.attn_res_block_size and cfg.activation == "situ"
    assert cfg.moe.latent_size and cfg.moe.latent_norm and cfg.moe.num_shared_experts
    assert "mlp" in tiny_np_weights["layers"][0] and "block_sparse_moe" in tiny_np_weights["layers"][1]
    assert cfg.kda.gate_form == "lower_bound" and cfg.kda.output_gate_rank is None and cfg.mla.output_gate


def test_logits_vs_numpy_2x20(logits_2x20, ids_2x20, tiny_np_weights):
    """T = 20 > top-k 8, so rows t >= 8 of both MLA layers attend to a sparse key set."""
    assert ids_2x20.shape[1] > tiny_np_weights["cfg"]["mla"]["index_topk"]
    _check_vs_numpy(logits_2x20, ids_2x20, tiny_np_weights)


def test_logits_vs_numpy_1x70(logits_1x70, ids_1x70, tiny_np_weights):
    """T = 70 > chunk 64: the chunked KDA prefill carries its state across a chunk boundary."""
    _check_vs_numpy(logits_1x70, ids_1x70, tiny_np_weights)


def test_indexer_sparsity_changes_logits(logits_2x20, ids_2x20, tiny_np_weights):
    """Dense MLA (no DSA mask) gives clearly different logits: the top-k path is really exercised."""
    import copy

    w = copy.deepcopy(tiny_np_weights)
    for lw in w["layers"]:
        lw["self_attn"].pop("indexer", None)
    dense = numpy_forward(w, ids_2x20[0], ref)
    assert np.abs(dense - logits_2x20[0]).max() > 1e-2 * logits_2x20.std()


def test_naive_and_absorbed_mla_forms_agree(tiny_model, ids_2x20, logits_2x20):
    naive = tiny_model.logits(ids_2x20, mla_form="naive")
    scale = np.abs(logits_2x20).max()
    assert np.abs(naive - logits_2x20).max() <= 1e-5 * scale
    np.testing.assert_array_equal(naive.argmax(-1), logits_2x20.argmax(-1))


def test_prefill_then_decode_equals_full_forward(tiny_model, ids_1x70, logits_1x70):
    """Prefill 66 tokens (KDA chunks 64 + 2) into a 70-token cache, then decode 4 tokens one at a time."""
    P, T = 66, ids_1x70.shape[1]
    logits_p, cache = tiny_model.prefill(ids_1x70[:, :P], T)
    steps = [np.asarray(logits_p, np.float32)]
    for t in range(P, T):
        lg, cache = tiny_model.decode_step(cache, ids_1x70[:, t])
        steps.append(np.asarray(lg, np.float32)[:, None])
    got = np.concatenate(steps, axis=1)
    assert np.all(np.asarray(cache.length) == T)  # scalar or per-sequence [B]
    scale = np.abs(logits_1x70).max()
    err = np.abs(got - logits_1x70).max()
    assert err <= 1e-4 * scale, f"max abs diff {err:.3e} vs logit scale {scale:.3e}"
    np.testing.assert_array_equal(got.argmax(-1), logits_1x70.argmax(-1))


def test_prefill_chunks_bound_the_programs_a_long_prompt_compiles():
    from kimi_jax.model import prefill_chunks

    assert prefill_chunks(70, 2048) == [70]  # one chunk: the prompt as it is
    assert prefill_chunks(70, 32) == [32, 32, 4, 2]
    sizes = {s for n in range(1, 5000) for s in prefill_chunks(n, 1024) if n > 1024}
    assert all(sum(prefill_chunks(n, 1024)) == n for n in range(1, 5000))
    assert sizes == {1024, 512, 256, 128, 64, 32, 16, 8, 4, 2, 1}


def test_long_prompts_run_in_chunks_and_give_the_same_logits(tiny_model, ids_1x70, logits_1x70):
    """With chunks of 32 tokens the 70-token prompt runs as 32 + 32 + 4 + 2: `logits` through a paged cache,
    `prefill` into its contiguous cache, `generate` in a paged cache -- the same logits and greedy tokens as the
    one-shot forward (float32)."""
    import copy

    chunked = copy.copy(tiny_model)  # the same parameters and programs, another chunk size
    chunked.prefill_chunk_tokens = 32
    scale = np.abs(logits_1x70).max()
    np.testing.assert_allclose(chunked.logits(ids_1x70), logits_1x70, atol=1e-4 * scale)
    all_logits, cache = chunked.prefill(ids_1x70, 72)
    np.testing.assert_allclose(np.asarray(all_logits), logits_1x70, atol=1e-4 * scale)
    last, _ = chunked.prefill(ids_1x70, 72, logits="last")
    np.testing.assert_allclose(np.asarray(last)[:, 0], logits_1x70[:, -1], atol=1e-4 * scale)
    prompt = ids_1x70[:, :66]
    np.testing.assert_array_equal(chunked.generate(prompt, 4), tiny_model.generate(prompt, 4))


def test_prefill_rejects_overlong_prompt(tiny_model, ids_1x70):
    with pytest.raises(ValueError):
        tiny_model.prefill(ids_1x70, 10)


def test_generate_greedy_deterministic_and_consistent(tiny_model, ids_1x70):
    """Greedy generate (prefill 66 + 4 new, the shapes above) is reproducible and matches argmax of the full forward."""
    prompt = ids_1x70[:, :66]
    a = tiny_model.generate(prompt, 4)
    b = tiny_model.generate(prompt, 4)
    assert a.shape == (1, 70)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a[:, :66], prompt)
    full = tiny_model.logits(a)  # same [1, 70] shape: no new compile
    np.testing.assert_array_equal(full[0, 65:69].argmax(-1), a[0, 66:70])
    np.testing.assert_array_equal(tiny_model.generate(prompt, 0), prompt)


def test_generate_sampling_seeded(tiny_model, ids_1x70):
    prompt = ids_1x70[:, :66]
    s0 = tiny_model.generate(prompt, 4, temperature=1.0, seed=0)
    np.testing.assert_array_equal(s0, tiny_model.generate(prompt, 4, temperature=1.0, seed=0))
    others = [tiny_model.generate(prompt, 4, temperature=1.0, seed=s) for s in (1, 2)]
    assert any(not np.array_equal(s0, o) for o in others)
    assert s0.min() >= 0 and s0.max() < VOCAB


@pytest.mark.parametrize("bad", [
    np.array([[1, 2, VOCAB]]),            # id == vocab size
    np.array([[1, -1, 3]]),               # negative id
    np.array([[1.0, 2.0]]),               # float ids
    np.zeros((1, 2, 3), np.int64),        # wrong rank
    np.zeros((1, 0), np.int64),           # no token
    np.zeros((0, 3), np.int64),           # no sequence
    [[1, 2, 3], [4, 5]],                  # ragged: numpy's own message was "inhomogeneous shape"
    [[]],                                 # empty (numpy makes it float64)
], ids=["too_large", "negative", "float", "rank3", "empty_sequence", "no_sequence", "ragged", "empty_list"])
def test_bad_input_ids_raise(tiny_model, bad):
    with pytest.raises(ValueError, match="input_ids|token ids"):
        tiny_model.logits(bad)
    with pytest.raises(ValueError, match="input_ids|token ids"):
        tiny_model.generate(bad, 2)


@pytest.mark.parametrize("n", [-1, 2.0, "2", True])
def test_generate_refuses_a_bad_max_new_tokens(tiny_model, n):
    with pytest.raises(ValueError, match="max_new_tokens"):
        tiny_model.generate(np.array([[1, 2]]), n)


def test_generate_refuses_bad_sampling_arguments_and_logits_too_long_an_input(tiny_model):
    """temperature NaN sampled token 0 every step and a negative one was silently greedy; a seed outside int64
    failed inside JAX; logits took inputs longer than max_position_embeddings, which generate refuses."""
    for temperature in (float("nan"), float("inf"), -1.0, True, "0.5"):
        with pytest.raises(ValueError, match="temperature"):
            tiny_model.generate(np.array([[1, 2]]), 2, temperature=temperature)
    for seed in (2 ** 63, None, 1.5):
        with pytest.raises(ValueError, match="seed"):
            tiny_model.generate(np.array([[1, 2]]), 2, temperature=0.5, seed=seed)
    assert tiny_model.generate(np.array([[1, 2]]), 2, temperature=0.5, seed=-(2 ** 63)).shape == (1, 4)
    too_long = np.ones((1, tiny_model.config.max_position_embeddings + 1), np.int64)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        tiny_model.logits(too_long)


def test_load_model_dtype_names():
    """`load_model(..., dtype=)` takes a dtype or a name, with the command lines' spellings (bf16, fp32); a name
    that is not a floating-point dtype is a clear ValueError."""
    import jax.numpy as jnp

    import kimi_jax
    from kimi_jax.model import _parse_dtype

    assert _parse_dtype("bf16") == jnp.bfloat16 and _parse_dtype("bfloat16") == jnp.bfloat16
    assert _parse_dtype("fp32") == jnp.float32 and _parse_dtype(jnp.float32) == jnp.float32
    assert _parse_dtype(None) is None
    for bad in ("int8", "banana", "float64"):  # float64 without jax_enable_x64 would silently stay float32
        with pytest.raises(ValueError, match="bf16"):
            kimi_jax.load_model("tiny", dtype=bad)


def test_random_weights_with_mxfp4_experts_draw_no_dense_expert(tiny_model):
    """`checkpoint.random_mxfp4_model`: the routed experts are MXFP4 from the start (random e2m1 codes under one
    E8M0 scale per matrix); every other parameter comes from its module's initialiser, drawn by programs that
    return only those -- so no dense expert weight is ever allocated. The logits are finite and of the size a
    dense random model gives."""
    import jax.numpy as jnp

    from kimi_jax.checkpoint import random_mxfp4_model
    from kimi_jax.modules.moe import moe_layers
    from pallas_kernels.moe.experts import MXFP4Experts

    model = random_mxfp4_model(tiny_model.config, seed=0, dtype=jnp.float32)
    layers = moe_layers(model.module)
    assert layers and all(isinstance(m.expert_weights(), MXFP4Experts) for _, m in layers)
    scale = layers[0][1].expert_weights().gate.scale
    assert np.unique(np.asarray(scale)).size == 1  # one scale per matrix
    ids = np.random.default_rng(102).integers(0, VOCAB, (1, 20))
    got, want = model.logits(ids), tiny_model.logits(ids)
    assert np.isfinite(got).all() and 0.5 < got.std() / want.std() < 2.0


def test_random_expert_codes_are_drawn_in_bounded_scratch():
    """One layer's MXFP4 codes at K3.1's expert shape (64 experts of 3072 x 3584 inputs, two codes a byte): the
    draw's scratch stays a small fraction of its output (a whole uint8 draw takes about 16x its output)."""
    import jax

    from kimi_jax.checkpoint import _random_bytes

    shape = (64, 3072, 1792)
    mem = jax.jit(_random_bytes, static_argnums=1).lower(jax.random.key(0), shape).compile().memory_analysis()
    assert mem.output_size_in_bytes == np.prod(shape)
    assert mem.temp_size_in_bytes < mem.output_size_in_bytes / 4
    odd = np.asarray(jax.jit(_random_bytes, static_argnums=1)(jax.random.key(1), (3, 5, 7)))  # not whole words
    assert odd.shape == (3, 5, 7) and odd.dtype == np.uint8 and len(np.unique(odd)) > 50


def test_the_server_draws_a_presets_experts_as_mxfp4_when_asked():
    """`python -m kimi_jax.serve --random-experts mxfp4`: the preset's routed experts come as MXFP4."""
    from kimi_jax.modules.moe import moe_layers
    from kimi_jax.serve.server import load_for_serving
    from pallas_kernels.moe.experts import MXFP4Experts

    model, tok, name = load_for_serving(None, "tiny", random_experts="mxfp4")
    assert name == "tiny" and tok.vocab_size == model.config.vocab_size
    assert all(isinstance(m.expert_weights(), MXFP4Experts) for _, m in moe_layers(model.module))
