"""The plain sampler (`EngineConfig.plain_sampling`): every decode and verify program built a second time without the
sampler's two `lax.cond`s (the top-k / top-p / min-p filter, the top log-probs), run when no running sequence uses
either.

On a GPU each `lax.cond` outside XLA's command buffers copies its predicate to the host and blocks until the device
has caught up, once per step. The plain programs hold no conditional at all; for the rows they run they give the
same tokens, log-probs and counts as the programs with both branches, and the engine picks them only where the host
copy of the rows (`RowParams.needs_branches`) says the device predicates would be false.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimi_jax.config import get_preset
from kimi_jax.engine import Engine, EngineConfig, SamplingParams
from kimi_jax.engine.guide import ALL, MAX_ALLOWED_IDS, NUM_VOCAB_CLASSES
from kimi_jax.engine.sampler import Controls, RowParams, Tables, sample, uses_filter
from kimi_jax.model import random_model
from kimi_jax.tokenizer import Tokenizer

B, V = 8, 64


def _inputs(rng, params: list[SamplingParams]):
    rows = RowParams(B, V)
    for b, p in enumerate(params):
        rows.set(b, p, seed=100 + b, choice=0)
    logits = rng.normal(0, 2.0, (B, V)).astype(np.float32)
    counts = rng.integers(0, 3, (B, V)).astype(np.int32)
    prompt_mask = rng.random((B, V)) < 0.2
    ctl = Controls(np.arange(B, dtype=np.int32), np.ones(B, bool), np.full(B, ALL, np.int32),
                   np.full((B, MAX_ALLOWED_IDS), V, np.int32))
    tables = Tables(np.ones((NUM_VOCAB_CLASSES, V), bool), np.zeros(V, bool))
    return logits, rows, ctl, counts, prompt_mask, tables


def test_plain_sampler_gives_the_same_outputs_for_rows_that_use_neither_branch():
    """Greedy and tempered rows with penalties and a logit bias, none filtered, none asking for top log-probs."""
    rng = np.random.default_rng(0)
    params = [SamplingParams(temperature=t, repetition_penalty=1.1, frequency_penalty=0.3, logit_bias={3: 2.0})
              for t in (0.0, 0.8, 1.3, 0.0, 0.5, 1.0, 0.0, 2.0)]
    logits, rows, ctl, counts, prompt_mask, tables = _inputs(rng, params)
    assert not rows.needs_branches(range(B))
    run = jax.jit(sample, static_argnames="plain")
    want = jax.tree.map(np.asarray, run(logits, rows.device(), ctl, counts, prompt_mask, tables))
    got = jax.tree.map(np.asarray, run(logits, rows.device(), ctl, counts, prompt_mask, tables, plain=True))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(g, w)


def test_plain_sampler_lowers_without_a_conditional():
    logits, rows, ctl, counts, prompt_mask, tables = _inputs(np.random.default_rng(1), [SamplingParams()] * B)
    args = (logits, rows.device(), ctl, counts, prompt_mask, tables)
    branched = jax.jit(sample).lower(*args).as_text()
    plain = jax.jit(sample, static_argnames="plain").lower(*args, plain=True).as_text()
    assert branched.count("stablehlo.case") == 2
    assert "stablehlo.case" not in plain


def test_needs_branches_is_the_device_predicates_on_the_host():
    """Over random parameters and slot subsets: the host answer equals the two `lax.cond` predicates the programs
    evaluate over the same rows (a filter on some tempered row, top log-probs on some row)."""
    rng = np.random.default_rng(2)
    for trial in range(40):
        params = [SamplingParams(temperature=float(rng.choice([0.0, 0.7])), top_p=float(rng.choice([1.0, 1.0, 0.9])),
                                 top_k=int(rng.choice([0, 0, 0, 5])), min_p=float(rng.choice([0.0, 0.0, 0.1])),
                                 logprobs=bool(rng.random() < 0.2), top_logprobs=int(rng.choice([0, 3])))
                  for _ in range(B)]
        rows = RowParams(B, V)
        for b, p in enumerate(params):
            rows.set(b, p, seed=0, choice=0)
        slots = np.flatnonzero(rng.random(B) < 0.5)
        d = rows.device()
        take = lambda a: jnp.asarray(a)[slots]
        device = bool(jnp.any(uses_filter(take(d.temperature), take(d.top_k), take(d.top_p), take(d.min_p)))
                      | jnp.any(take(d.top_logprobs) > 0))
        assert rows.needs_branches(slots) == device, (trial, slots)


# ---------------------------------------------------------------------------------------------------- the engine

@pytest.fixture(scope="module")
def model():
    return random_model(get_preset("tiny"))


def _prompt(seed: int, n: int) -> list[int]:
    return list(np.random.default_rng(seed).integers(5, 900, n))


def _serve(model, plain: bool, requests, *, async_scheduling=False, buckets=()) -> tuple[list, dict]:
    """Submit `requests` ((prompt, params, delay in generated tokens)) to an engine; return each request's
    (token ids, log-probs, top log-probs) and the engine's stats."""
    cfg = EngineConfig(max_num_seqs=4, max_model_len=256, prefill_chunk_sizes=(64, 1), plain_sampling=plain,
                       async_scheduling=async_scheduling, decode_buckets=buckets)
    eng = Engine(model, Tokenizer.tiny(), cfg).start()
    try:
        streams = []
        for prompt, params, after in requests:
            deadline = time.monotonic() + 300
            while eng.stats()["generation_tokens_total"] < after:
                assert time.monotonic() < deadline
                time.sleep(0.005)
            streams.append(eng.submit(prompt, params))
        outs = [s.collect(1)[0][0] for s in streams]
        stats = eng.stats()
        assert stats["compilations"] == stats["compilations_at_start"]
        got = [(o.token_ids, [t.logprob for t in o.logprobs], [t.top for t in o.logprobs]) for o in outs]
        return got, stats
    finally:
        eng.shutdown()


PLAIN_ONLY = [(_prompt(1, 30), SamplingParams(max_tokens=12, temperature=0.0, logprobs=True, ignore_eos=True), 0),
              (_prompt(2, 9), SamplingParams(max_tokens=16, temperature=0.9, seed=5, logprobs=True,
                                             presence_penalty=0.4, ignore_eos=True), 0)]
MIXED = PLAIN_ONLY + [
    (_prompt(3, 20), SamplingParams(max_tokens=6, temperature=1.0, top_p=0.8, top_k=20, seed=7, logprobs=True,
                                    ignore_eos=True), 4),
    (_prompt(4, 14), SamplingParams(max_tokens=5, temperature=0.0, logprobs=True, top_logprobs=3,
                                    ignore_eos=True), 8)]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_runs_plain_steps_while_no_running_request_needs_a_branch(model, async_scheduling):
    """Two plain requests, then one with top-p / top-k and one with top log-probs join while they run and end
    first: every step outside that stretch runs the plain programs, and every request gets the tokens, log-probs
    and top log-probs of the engine without them."""
    want, off = _serve(model, False, MIXED, async_scheduling=async_scheduling)
    got, on = _serve(model, True, MIXED, async_scheduling=async_scheduling)
    assert got == want
    assert off["steps_plain"] == 0
    assert 0 < on["steps_plain"] < sum(on["steps_by_rows"].values())  # of the steps dispatched
    assert (on["steps_overlapped"] > 0) == async_scheduling  # chained steps keep the plain programs


def test_bucketed_steps_run_the_plain_programs_of_their_width(model):
    """Decode buckets, overlapped: every step runs plain. (Which bucket runs a token depends on when the second
    request joins, so log-probs agree to the buckets' 1e-5.)"""
    got, on = _serve(model, True, PLAIN_ONLY, async_scheduling=True, buckets=(1, 2))
    want = _serve(model, False, PLAIN_ONLY, async_scheduling=True, buckets=(1, 2))[0]
    assert [g[0] for g in got] == [w[0] for w in want]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g[1], w[1], atol=1e-5)
    assert on["steps_plain"] == sum(on["steps_by_rows"].values())


def test_plain_sampling_defaults_to_gpus_only(model):
    eng = Engine(model, Tokenizer.tiny(), EngineConfig(max_num_seqs=2, max_model_len=128))
    assert eng.runner.plain_sampling is False
    assert not any("plain" in n for n in eng.runner.program_names)
