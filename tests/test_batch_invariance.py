"""Batch invariance: a request's tokens and log-probs do not depend on what else shares the batch.

The same request alone and beside 15 concurrent requests of other lengths, parameters, n and guides must come out
bit-identical -- tokens, sampled-token log-probs and top log-probs (``==`` on the floats, no tolerance): on the
shared float32 tiny server (serve_helpers), and on a bfloat16 tiny engine with speculative decoding (prompt lookup)
in its batch-invariant mode (every step a verify step), where the crowd drafts heavily.  Without that mode a row's
token comes from the verify program when another row drafts and from the one-token step otherwise: the same
tokens in float32 here, log-probs equal to float rounding (checked too).
"""

from __future__ import annotations

import threading

import jax.numpy as jnp
import pytest

from kimi_jax.engine import Engine, EngineConfig, SamplingParams
from kimi_jax.engine.guide import TokenSequenceGuide

PROBE = [(101, 40), (202, 7)]  # (seed of the prompt, length)


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 997 + 1 for i in range(n)]


def _repetitive(seed: int, n: int) -> list[int]:
    base = _prompt(seed, 6)
    return (base * (n // 6 + 1))[:n]


PARAMS = [SamplingParams(max_tokens=24, temperature=0.0, logprobs=True, top_logprobs=5, ignore_eos=True),
          SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, top_k=40, seed=7, logprobs=True, top_logprobs=3,
                         presence_penalty=0.3, repetition_penalty=1.1, ignore_eos=True)]


def _run(engine, prompt, params, n=1):
    return [(o.token_ids, [(lp.token_id, lp.logprob, lp.top) for lp in o.logprobs])
            for o in engine.generate(prompt, params, n=n)]


def _crowd(engine, count: int, make_prompt, start: threading.Event):
    """``count`` concurrent requests of varied shapes, submitted when ``start`` is set; returns their threads."""
    def one(i):
        start.wait()
        p = SamplingParams(max_tokens=10 + i % 4 * 9, temperature=[0.0, 0.7, 1.2][i % 3], seed=i, top_k=[0, 5][i % 2],
                           logprobs=bool(i % 2), top_logprobs=i % 4, ignore_eos=True, frequency_penalty=0.1 * (i % 3))
        guide = (lambda: TokenSequenceGuide([5, 6, 7, 8])) if i % 5 == 0 else None
        engine.generate(make_prompt(500 + i, 3 + 11 * i % 90), p, n=1 + i % 2, guide_factory=guide)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    return threads


def _alone_vs_crowd(engine, make_prompt, n=1):
    for seed, length in PROBE:
        for params in PARAMS:
            prompt = make_prompt(seed, length)
            alone = _run(engine, prompt, params, n)
            start = threading.Event()
            threads = _crowd(engine, 15, make_prompt, start)
            start.set()
            crowded = _run(engine, prompt, params, n)
            for t in threads:
                t.join(120)
            assert crowded == alone, (seed, length, params)


def test_float32_server_engine_alone_vs_beside_15(served):
    _alone_vs_crowd(served.engine, _prompt, n=2)


@pytest.fixture(scope="module")
def bf16_spec_engine():
    import kimi_jax

    model = kimi_jax.load_model("tiny", dtype=jnp.bfloat16)
    from kimi_jax.tokenizer import Tokenizer

    cfg = EngineConfig(max_num_seqs=16, max_model_len=192, prefill_chunk_sizes=(16,), speculative_tokens=3,
                       speculative_batch_invariant=True)
    eng = Engine(model, Tokenizer.tiny(), cfg).start()
    yield eng
    eng.shutdown()


def test_bf16_speculative_alone_vs_beside_15_drafting_requests(bf16_spec_engine):
    _alone_vs_crowd(bf16_spec_engine, _repetitive)
    assert bf16_spec_engine.stats()["spec_verify_steps"] > 0


def test_float32_speculative_default_mode_equal_to_rounding(served, tiny_model):
    """Outside the batch-invariant mode (here: verify whenever some row drafts) the probe's tokens come from the
    verify program or the one-token step depending on the crowd: the same greedy tokens in float32, log-probs equal
    to rounding."""
    cfg = EngineConfig(max_num_seqs=16, max_model_len=192, prefill_chunk_sizes=(16,), speculative_tokens=3,
                       speculative_adaptive=False)
    eng = Engine(tiny_model, served.tokenizer, cfg).start()
    try:
        prompt, params = _repetitive(101, 40), PARAMS[0]
        (alone,) = _run(eng, prompt, params)
        start = threading.Event()
        threads = _crowd(eng, 15, _repetitive, start)
        start.set()
        (crowded,) = _run(eng, prompt, params)
        for t in threads:
            t.join(120)
        assert crowded[0] == alone[0]
        for (ta, la, _), (tc, lc, _) in zip(alone[1], crowded[1]):
            assert ta == tc and abs(la - lc) < 1e-5
    finally:
        eng.shutdown()
