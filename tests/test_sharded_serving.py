"""The serving engine on a mesh of 8 faked CPU devices against one device (docs/serving.md, "Sharded serving").

Decode context parallelism (`EngineConfig.dcp`, `serve --dcp N`): every sequence's cached MLA tokens split N ways,
round-robin over the mesh's tensor axis (`--mesh 8x1 --dcp 8`) or a context axis (`expert=8,tensor=1,context=8`),
KDA states split by heads (or value columns). The engine must give the same greedy tokens as one device, with
log-probs within float32 noise — across prefill chunks, decode steps and preemptions — while each device holds at
most 1/8 of one device's cache bytes plus one page per MLA layer.

Subprocesses, because the CPU device count is fixed once per process when JAX starts its backend.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from server_process import cpu_devices_env

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(r"""
    import json, sys
    import numpy as np
    from kimi_jax.config import get_preset
    from kimi_jax.engine import Engine, EngineConfig, SamplingParams
    from kimi_jax.model import random_model
    from kimi_jax.tokenizer import Tokenizer

    mesh, dcp, lengths, gen, tight = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4]), \
        json.loads(sys.argv[5])
    cfg = get_preset("tiny")
    if sys.argv[6] == "no-indexer":  # MLA without the DSA indexer (as Kimi-Linear): dense attention over pages
        cfg = cfg.replace(indexer=None)
    tok = Tokenizer.tiny()
    rng = np.random.RandomState(0)
    prompts = [list(map(int, rng.randint(5, 900, n))) for n in lengths]
    params = SamplingParams(max_tokens=gen, temperature=0.0, logprobs=True, ignore_eos=True)

    def run(model, dcp, num_blocks=None):
        cfg = EngineConfig(max_num_seqs=4, max_model_len=1024, prefill_chunk_sizes=(64, 1), dcp=dcp,
                           num_blocks=num_blocks)
        eng = Engine(model, tok, cfg).start()
        streams = [eng.submit(p, params) for p in prompts]
        outs = [s.collect(1)[0][0] for s in streams]
        stats = eng.stats()
        eng.shutdown()
        return [o.token_ids for o in outs], [[t.logprob for t in o.logprobs] for o in outs], stats

    one = run(random_model(cfg), 1)
    sharded = run(random_model(cfg, mesh=mesh), dcp, num_blocks=tight)
    result = {"tokens_equal": one[0] == sharded[0],
              "max_dlogprob": max(float(np.abs(np.subtract(a, b)).max()) for a, b in zip(one[1], sharded[1])),
              "one": {k: one[2][k] for k in ("cache_bytes_per_device", "max_cached_tokens", "block_tokens")},
              "sharded": {k: sharded[2][k] for k in ("cache_bytes_per_device", "max_cached_tokens", "block_tokens",
                                                       "dcp", "num_preemptions")}}
    print(json.dumps(result))
""")


def _run(mesh: str, dcp: int, lengths=(7, 70, 200, 600), gen: int = 10, tight=None, indexer: bool = True) -> dict:
    env = cpu_devices_env(8)
    args = [mesh, str(dcp), json.dumps(list(lengths)), str(gen), json.dumps(tight),
            "indexer" if indexer else "no-indexer"]
    out = subprocess.run([sys.executable, "-c", SCRIPT, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=1500)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["8x1", "expert=8,tensor=1,context=8"])
def test_dcp8_engine_equals_one_device_in_an_eighth_of_the_cache(mesh):
    """A 600-token prompt crosses many prefill chunks and pages on every rank; 7 tokens fill less than a page."""
    from kimi_jax.cache import CacheLayout
    from kimi_jax.config import get_preset

    r = _run(mesh, 8)
    assert r["tokens_equal"], r
    assert r["max_dlogprob"] < 1e-4, r
    one, sharded = r["one"], r["sharded"]
    assert sharded["dcp"] == 8 and sharded["block_tokens"] == 8 * one["block_tokens"]
    assert sharded["max_cached_tokens"] == one["max_cached_tokens"]
    # fp32 tiny model: one page of every MLA layer
    layout = CacheLayout(get_preset("tiny"), kv_dtype="fp32", index_dtype="fp32", activation_bytes=4)
    bound = one["cache_bytes_per_device"] / 8 + layout.page_bytes
    if mesh != "8x1":  # tensor=1: the KDA states cannot split by heads and stay whole on every device
        bound += 4 * layout.state_bytes_per_sequence
    assert sharded["cache_bytes_per_device"] <= bound, r


@pytest.mark.slow
def test_preemption_under_dcp_with_data_parallel_rows_equals_one_device():
    """`--mesh 2x4 --dcp 2` (DCP over the tensor axis, slots over data) on MLA without an indexer (the dense paged
    attention per rank): a pool of 8 pages of 128 positions per rank cannot hold four sequences growing to 3 pages
    each, so the youngest are preempted and recomputed; the tokens are still one device's."""
    r = _run("2x4", 2, lengths=(100, 110, 120, 125), gen=140, tight=9, indexer=False)
    assert r["sharded"]["num_preemptions"] > 0, r
    assert r["tokens_equal"], r
    assert r["max_dlogprob"] < 1e-4, r


PLAN_SCRIPT = textwrap.dedent(r"""
    import contextlib, io, json
    import numpy as np, jax.numpy as jnp
    from kimi_jax import plan
    from kimi_jax.config import get_preset
    from kimi_jax.engine.guide import NUM_VOCAB_CLASSES
    from kimi_jax.engine.runner import ModelRunner
    from kimi_jax.model import abstract_model

    cases = [("tiny", "1x1", 1, "fp32", "fp32"), ("tiny", "8x1", 8, "fp32", "fp32"), ("tiny", "2x4", 2, "bf16", "bf16"),
             ("kimi-k3.1-pro", "8x1", 8, "bf16", "fp8"), ("kimi-k3.1-pro", "8x1", 1, "bf16", "nvfp4"),
             ("kimi-linear-48b", "4x2", 4, "bf16", "bf16")]
    for preset, mesh, dcp, dtype, kv in cases:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert plan.main(["--config", preset, "--mesh", mesh, "--dcp", str(dcp), "--kv-dtype", kv,
                              "--index-dtype", "fp8" if kv in ("fp8", "nvfp4") else kv, "--max-num-seqs", "4",
                              "--max-model-len", "4096", "--dtype", dtype, "--json"]) == 0
        predicted = json.loads(out.getvalue())["engine"]
        cfg = get_preset(preset)
        model = abstract_model(cfg, mesh=mesh, dtype=jnp.bfloat16 if dtype == "bf16" else jnp.float32)
        runner = ModelRunner(model, max_num_seqs=4, max_model_len=4096, prefill_chunk_sizes=(64,), kv_dtype=kv,
                             class_masks=np.zeros((NUM_VOCAB_CLASSES, cfg.vocab_size), bool),
                             stop_mask=np.zeros(cfg.vocab_size, bool), dcp=dcp)
        got = {"num_blocks": runner.spec.num_blocks, "cache_bytes_per_device": runner.cache_bytes_per_device(),
               "max_cached_tokens": runner.max_cached_tokens, "block_tokens": runner.block_tokens,
               "checkpoint_bytes_per_device": runner.cache1_bytes_per_device()}
        assert all(predicted[k] == v for k, v in got.items()), (preset, mesh, dcp, predicted, got)
        print(preset, mesh, dcp, "ok", got["cache_bytes_per_device"])
""")


def test_planner_predicts_what_the_engine_allocates_on_every_mesh():
    """`python -m kimi_jax.plan --max-num-seqs B --max-model-len L` (with --mesh, --dcp and the dtypes) gives the
    pages, per-device cache bytes and capacity that the engine's runner places (from abstract shapes: nothing is
    compiled), at tiny and full size."""
    env = cpu_devices_env(8)
    out = subprocess.run([sys.executable, "-c", PLAN_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.count(" ok ") == 6, out.stdout
