"""Decode batch buckets (`EngineConfig.decode_buckets`): a step with few sequences running runs a program over just
their slots (the smallest compiled bucket that holds them, padded with free slots) instead of all max_num_seqs.

A sequence's tokens and log-probs must not depend on which program ran its steps: the same requests through an
engine with buckets and one without give the same tokens and log-probs, for plain decoding and for speculative
verify steps, as the load rises and falls across the buckets; nothing compiles after start.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from kimi_jax.config import get_preset
from kimi_jax.engine import Engine, EngineConfig, SamplingParams
from kimi_jax.engine.engine import default_decode_buckets
from kimi_jax.model import random_model
from kimi_jax.tokenizer import Tokenizer


def test_default_buckets_are_powers_of_two_below_the_slots_and_split_over_data():
    assert default_decode_buckets(32) == (1, 2, 4, 8, 16)
    assert default_decode_buckets(32, data_ways=4) == (4, 8, 16)
    assert default_decode_buckets(1) == ()


@pytest.fixture(scope="module")
def model():
    return random_model(get_preset("tiny"))


def _run(model, buckets: tuple, spec: int, async_scheduling: bool = False) -> tuple[list, list]:
    cfg = EngineConfig(max_num_seqs=4, max_model_len=256, prefill_chunk_sizes=(64, 1), decode_buckets=buckets,
                       speculative_tokens=spec, speculative_adaptive=False, async_scheduling=async_scheduling)
    eng = Engine(model, Tokenizer.tiny(), cfg).start()
    try:
        rng = np.random.default_rng(0)
        # a repeating prompt gives prompt lookup something to draft
        prompts = [list(rng.integers(5, 900, 12)) * 3, list(rng.integers(5, 900, 40)), list(rng.integers(5, 900, 7)),
                   list(rng.integers(5, 900, 70))]
        params = [SamplingParams(max_tokens=n, temperature=0.0, logprobs=True, ignore_eos=True) for n in (30, 6, 14, 3)]
        # one alone first (bucket 1), then three more join (buckets 2 and 4) and finish at different steps
        first = eng.submit(prompts[0], params[0])
        deadline = time.monotonic() + 300
        while eng.stats()["generation_tokens_total"] < 4:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        rest = [eng.submit(p, sp) for p, sp in zip(prompts[1:], params[1:])]
        outs = [first.collect(1)[0][0]] + [s.collect(1)[0][0] for s in rest]
        stats = eng.stats()
        assert stats["compilations"] == stats["compilations_at_start"]
        if buckets:  # the load rose and fell through every width
            assert set(stats["steps_by_rows"]) == {"1", "2", "4"}, stats["steps_by_rows"]
        assert (stats["steps_overlapped"] > 0) == async_scheduling
        return [o.token_ids for o in outs], [[t.logprob for t in o.logprobs] for o in outs]
    finally:
        eng.shutdown()


def test_buckets_give_the_full_steps_tokens(model):
    """Speculative (prompt lookup, always verified when a row drafts): step and verify programs of every width."""
    full_tokens, full_lps = _run(model, (), 2)
    tokens, lps = _run(model, (1, 2), 2)
    assert tokens == full_tokens
    for a, b in zip(lps, full_lps):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_overlapped_bucket_steps_give_the_tokens_of_one_step_at_a_time(model):
    """Async scheduling over buckets: a chained step takes the bucket's tokens as the step before left them (its
    rows in the bucket's slot order) and the bucket's rows of the block table. (Which bucket runs a given token
    depends on when the later requests join, and a bucket's width changes the projections' summation order: the
    log-probs agree to 3e-5.)"""
    want_tokens, want_lps = _run(model, (1, 2), 0)
    tokens, lps = _run(model, (1, 2), 0, async_scheduling=True)
    assert tokens == want_tokens
    for a, b in zip(lps, want_lps):
        np.testing.assert_allclose(a, b, atol=3e-5)


def test_a_kda_layer_over_slots_equals_it_over_the_gathered_rows(model):
    """A bucket's decode step runs KDA against its slots of the whole per-slot cache (`KDASlots`): the outputs and
    the new rows of slots [3, 0] of a 5-slot cache are those of the same step on the two rows gathered, and the
    other slots keep what they held."""
    import jax
    import jax.numpy as jnp

    from kimi_jax.modules.kda import KDACache, KDASlots

    layer = model.module.layers[0].self_attn
    cfg = layer.cfg
    keys = iter(jax.random.split(jax.random.key(7), 8))
    tail = lambda: jax.random.normal(next(keys), (5, cfg.conv_kernel - 1, cfg.num_heads * cfg.head_dim))
    pool = KDACache(0.1 * jax.random.normal(next(keys), (5, cfg.num_heads, cfg.head_dim, cfg.head_dim)),
                    tail(), tail(), tail())
    slots = jnp.array([3, 0], jnp.int32)
    x = jax.random.normal(next(keys), (2, 1, model.config.hidden_size))

    want_out, want = layer(x, jax.tree.map(lambda a: a[slots], pool))
    got_out, got = layer(x, KDASlots(pool, slots))
    np.testing.assert_allclose(np.asarray(got_out), np.asarray(want_out), rtol=1e-6, atol=1e-6)
    assert isinstance(got, KDASlots) and np.array_equal(np.asarray(got.slots), [3, 0])
    for new_pool, new_rows, old in zip(got.pool, want, pool):
        np.testing.assert_allclose(np.asarray(new_pool)[[3, 0]], np.asarray(new_rows), rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(new_pool)[[1, 2, 4]], np.asarray(old)[[1, 2, 4]])
    with pytest.raises(ValueError, match="for decode"):
        layer(jnp.concatenate([x, x], axis=1), KDASlots(pool, slots), use_chunk=True)


MESH_SCRIPT = r"""
import json, sys
import numpy as np
from kimi_jax.config import get_preset
from kimi_jax.engine import Engine, EngineConfig, SamplingParams
from kimi_jax.model import random_model
from kimi_jax.tokenizer import Tokenizer

def run(model, buckets):
    cfg = EngineConfig(max_num_seqs=4, max_model_len=256, prefill_chunk_sizes=(64, 1), decode_buckets=buckets)
    eng = Engine(model, Tokenizer.tiny(), cfg).start()
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, logprobs=True, ignore_eos=True)
    outs = [eng.submit([5 + i, 40, 7 * i + 3, 9], params).collect(1)[0][0] for i in range(2)]
    rows = eng.stats()["steps_by_rows"]
    eng.shutdown()
    return [o.token_ids for o in outs], [[t.logprob for t in o.logprobs] for o in outs], rows

cfg = get_preset("tiny")
kernels, TOKENS = None, 8
if sys.argv[1] == "gpu-glue":  # the GPU decode-glue kernels (norms, expert selection, KDA step), interpreted: slow
    from kimi_jax.kernels import KernelConfig
    kernels, TOKENS = KernelConfig(kda="gpu_interpret", moe="gpu", moe_interpret=True, norm="gpu_interpret"), 4
one = run(random_model(cfg), ())
results = {}
for mesh in sys.argv[2:]:
    model = random_model(cfg, mesh=mesh, kernels=kernels)
    if kernels is not None:  # whole KDA heads per device: the layers take the one-kernel decode step
        from sharding.kda import decode_step_splits
        assert decode_step_splits(model.ctx, cfg.kda.num_heads, cfg.kda.head_dim), mesh
    meshed = run(model, (2,))
    results[mesh] = {"tokens_equal": one[0] == meshed[0], "rows": meshed[2],
                     "max_dlogprob": max(float(np.abs(np.subtract(a, b)).max()) for a, b in zip(one[1], meshed[1]))}
print(json.dumps(results))
"""


def test_buckets_on_a_mesh_equal_one_device():
    """Bucket steps on 8 faked CPU devices give one device's tokens: over 8 tensor ways (8x1) each device updates
    its heads' columns of the bucket's slots in place; with a data axis of 2 (4x2) the bucket's rows are gathered
    (a slot's KDA state lives on one data shard)."""
    _check_meshes("plain", "8x1", "4x2")


def test_the_gpu_decode_glue_on_a_mesh_equals_one_device():
    """The GPU kernels of a bucket step's glue (RMSNorm, the MoE's expert selection, the KDA decode step), here in
    Triton's interpreter, per device under shard_map over 2 tensor ways (the tiny model's 2 KDA heads, one per
    device; over more ways its heads' columns split and KDA keeps the XLA step), give one device's tokens. (The
    norm over a data axis: tests/test_norm.py.)"""
    _check_meshes("gpu-glue", "2x1")


def _check_meshes(kernels: str, *meshes: str):
    import json
    import subprocess
    import sys
    from pathlib import Path

    from server_process import cpu_devices_env

    out = subprocess.run([sys.executable, "-c", MESH_SCRIPT, kernels, *meshes],
                         cwd=Path(__file__).resolve().parents[1], env=cpu_devices_env(8), capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    for mesh, result in json.loads(out.stdout.strip().splitlines()[-1]).items():
        assert result["tokens_equal"] and result["max_dlogprob"] < 1e-4, (mesh, result)
        assert result["rows"].get("2", 0) > 0, (mesh, result)
