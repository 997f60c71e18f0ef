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
    depends on when the later requests join, so log-probs agree to the buckets' 1e-5.)"""
    want_tokens, want_lps = _run(model, (1, 2), 0)
    tokens, lps = _run(model, (1, 2), 0, async_scheduling=True)
    assert tokens == want_tokens
    for a, b in zip(lps, want_lps):
        np.testing.assert_allclose(a, b, atol=1e-5)
