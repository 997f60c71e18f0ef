"""The serving engine on a mesh of 8 faked CPU devices against one device (docs/serving.md, "Sharded serving").

Decode context parallelism (`EngineConfig.dcp`, `serve --dcp N`): every sequence's cached MLA tokens split N ways,
round-robin over the mesh's tensor axis (`--mesh 8x1 --dcp 8`) or a context axis (`expert=8,tensor=1,context=8`),
KDA states split by heads (or value columns). The engine must give the same greedy tokens as one device, with
log-probs within float32 noise — across prefill chunks, decode steps and a preemption — while each device holds at
most 1/8 of one device's cache bytes plus one page per MLA layer.

Subprocesses, because the CPU device count is fixed once per process when JAX starts its backend.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(r"""
    import json, sys
    import numpy as np
    import kimi_jax
    from kimi_jax.engine import Engine, EngineConfig, SamplingParams
    from kimi_jax.tokenizer import Tokenizer

    mesh, dcp = sys.argv[1], int(sys.argv[2])
    tok = Tokenizer.tiny()
    rng = np.random.RandomState(0)
    # a 600-token prompt crosses many prefill chunks and pages on every rank; 7 tokens fill less than a page
    prompts = [list(map(int, rng.randint(5, 900, n))) for n in (7, 70, 200, 600)]
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=True, ignore_eos=True)

    def run(model, dcp, num_blocks=None):
        cfg = EngineConfig(max_num_seqs=4, max_model_len=1024, prefill_chunk_sizes=(64, 1), dcp=dcp,
                           num_blocks=num_blocks)
        eng = Engine(model, tok, cfg).start()
        streams = [eng.submit(p, params) for p in prompts]
        outs = [s.collect(1)[0][0] for s in streams]
        stats = eng.stats()
        eng.shutdown()
        return ([o.token_ids for o in outs], [[t.logprob for t in o.logprobs] for o in outs], stats)

    one = run(kimi_jax.load_model("tiny"), 1)
    sharded_model = kimi_jax.load_model("tiny", mesh=mesh)
    sharded = run(sharded_model, dcp)
    # a pool too small for all four sequences at once: the youngest is preempted and recomputed on the mesh
    tight = run(sharded_model, dcp, num_blocks=1 + 3)
    result = {"tokens_equal": one[0] == sharded[0] == tight[0],
              "max_dlogprob": max(float(np.abs(np.subtract(a, b)).max()) for a, b in zip(one[1], sharded[1])),
              "one": {k: one[2][k] for k in ("cache_bytes_per_device", "max_cached_tokens", "block_tokens")},
              "sharded": {k: sharded[2][k] for k in ("cache_bytes_per_device", "max_cached_tokens", "block_tokens",
                                                       "dcp")},
              "preemptions": tight[2]["num_preemptions"]}
    print(json.dumps(result))
""")


def _run(mesh: str, dcp: int) -> dict:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", SCRIPT, mesh, str(dcp)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=1500)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["8x1", "expert=8,tensor=1,context=8"])
def test_dcp8_engine_equals_one_device_in_an_eighth_of_the_cache(mesh):
    from kimi_jax.cache import CacheLayout
    from kimi_jax.config import get_preset

    r = _run(mesh, 8)
    assert r["tokens_equal"], r
    assert r["max_dlogprob"] < 1e-4, r
    assert r["preemptions"] > 0, r  # the tight pool did preempt, and the tokens still matched
    one, sharded = r["one"], r["sharded"]
    assert sharded["dcp"] == 8 and sharded["block_tokens"] == 8 * one["block_tokens"]
    assert sharded["max_cached_tokens"] == one["max_cached_tokens"]
    # fp32 tiny model: one page of every MLA layer
    page_per_layer = CacheLayout(get_preset("tiny"), kv_dtype="fp32", index_dtype="fp32").page_bytes
    assert sharded["cache_bytes_per_device"] <= one["cache_bytes_per_device"] / 8 + page_per_layer, r
