"""Overlapped decode steps (`EngineConfig.async_scheduling`, kimi_jax/engine/overlap.py): in plain decoding the next
step is dispatched before this one's tokens are read, its input tokens taken on the device from this step's output.

A request's tokens and log-probs must not depend on it: the same requests through an engine that overlaps its steps
and one that steps one at a time give the same tokens, bit for bit, whatever ends them (max_tokens, a stop id, a stop
string, max_model_len), with sampling, penalties and min_tokens, n > 1, requests joining while others decode and an
abort part-way; and steps do overlap. The block table a step in flight may still read is never written under it.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kimi_jax.engine import Engine, SamplingParams
from kimi_jax.paged_cache import NULL_BLOCK, BlockTable


def test_a_lent_block_table_is_changed_in_a_copy():
    table = BlockTable(rows=2, max_blocks=4)
    pages = [3]
    first = table.update({0: pages})
    before = first.copy()
    pages.append(5)  # the row grew into a page while a step holding `first` is in flight
    second = table.update({0: pages}, lent=True)
    assert second is not first and np.array_equal(first, before)
    assert second[0].tolist() == [3, 5, NULL_BLOCK, NULL_BLOCK]
    assert table.update({0: pages}, lent=True) is second  # nothing changed: no copy
    assert table.update({}, lent=False) is second and (second == NULL_BLOCK).all()  # not lent: in place


def _prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(5, 900, n).tolist()


def _requests(tokenizer) -> list:
    """(prompt, params, n): each ends its own way, at a different step."""
    stop_id = sorted(tokenizer.stop_ids)[0]
    return [
        (_prompt(1, 30), SamplingParams(max_tokens=17, temperature=0.0, logprobs=True, top_logprobs=3,
                                        ignore_eos=True), 1),
        (_prompt(2, 75), SamplingParams(max_tokens=9, temperature=0.9, seed=7, logprobs=True, frequency_penalty=0.5,
                                        ignore_eos=True), 2),
        (_prompt(3, 12), SamplingParams(max_tokens=40, temperature=1.0, seed=3, logprobs=True, min_tokens=6,
                                        stop_token_ids=[stop_id], top_k=50), 1),
        (_prompt(4, 50), SamplingParams(max_tokens=25, temperature=0.0, logprobs=True, stop=["e"],
                                        ignore_eos=True), 1),
        (_prompt(5, 400), SamplingParams(max_tokens=200, temperature=0.7, seed=11, logprobs=True,
                                         ignore_eos=True), 1),  # ends at max_model_len (512)
    ]


def _serve(engine: Engine, requests, join_after: int = 3) -> list:
    """The first two requests start alone; the rest join once the engine has generated `join_after` tokens."""
    first = [engine.submit(p, sp, n=n) for p, sp, n in requests[:2]]
    deadline = time.monotonic() + 300
    while engine.stats()["generation_tokens_total"] < join_after:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    rest = [engine.submit(p, sp, n=n) for p, sp, n in requests[2:]]
    out = []
    for stream, (_, _, n) in zip(first + rest, requests):
        outs, done = stream.collect(n)
        out.append([(o.token_ids, [t.logprob for t in o.logprobs], o.text, o.finish_reason) for o in outs])
    return out


@pytest.fixture(scope="module")
def engines(served):
    """Two engines over the shared engine's compiled runner: overlapped steps (on CPU only when asked for) and one
    at a time (the CPU default)."""
    base = served.engine
    overlapped = Engine(base.model, base.tokenizer, base.config, runner=base.runner, async_scheduling=True).start()
    one_at_a_time = Engine(base.model, base.tokenizer, base.config, runner=base.runner,
                           async_scheduling=False).start()
    yield overlapped, one_at_a_time
    overlapped.shutdown()
    one_at_a_time.shutdown()


def test_overlapped_steps_give_the_tokens_of_one_step_at_a_time(engines, served):
    overlapped, one_at_a_time = engines
    assert overlapped.async_scheduling and not one_at_a_time.async_scheduling
    assert not served.engine.async_scheduling  # None: off on CPU
    requests = _requests(served.tokenizer)
    got = _serve(overlapped, requests)
    want = _serve(one_at_a_time, requests)
    assert got == want
    reasons = {o[3] for r in got for o in r}
    assert {"length", "stop"} <= reasons, reasons
    st = overlapped.stats()
    assert st["async_scheduling"] and st["steps_overlapped"] > 0, st
    assert one_at_a_time.stats()["steps_overlapped"] == 0
    for engine in engines:  # the host's share of the decode steps: dispatching them, blocked reading their tokens
        st_ = engine.stats()
        assert st_["step_dispatch_seconds"] > 0 and st_["step_wait_seconds"] > 0, st_
    assert st["compilations"] == st["compilations_at_start"]
    assert st["running_seqs"] == 0 and st["used_blocks"] == st["prefix_cache_blocks"]  # every page given back


def test_an_abort_while_steps_overlap_ends_that_request_only(engines):
    overlapped, _ = engines
    long = overlapped.submit(_prompt(8, 20), SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True))
    other = overlapped.submit(_prompt(9, 20), SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    before = overlapped.stats()["steps_overlapped"]
    deadline = time.monotonic() + 300
    while overlapped.stats()["steps_overlapped"] < before + 5:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    threading.Thread(target=overlapped.abort, args=(long.request_id,)).start()
    outs, done = long.collect(1)
    assert outs[0].finish_reason == "abort" and len(outs[0].token_ids) < 300
    outs, _ = other.collect(1)
    assert outs[0].finish_reason == "length" and len(outs[0].token_ids) == 40
    assert overlapped.healthy


def test_a_full_engine_overlaps_while_requests_wait_for_a_slot(engines):
    """Every slot taken by a 24-token request and four 3-token requests waiting: the steps of the 24 overlap
    (nothing can be admitted), and the waiting requests start as slots free, with the tokens of one step at a
    time. (Overlapping only with nobody waiting would leave at most the last requests' 3 steps.)"""
    overlapped, one_at_a_time = engines
    slots = overlapped.B
    requests = [(_prompt(100 + i, 10), SamplingParams(max_tokens=24 if i < slots else 3, temperature=0.0,
                                                      ignore_eos=True), 1) for i in range(slots + 4)]

    def serve(engine):
        before = engine.stats()["steps_overlapped"]
        streams = [engine.submit(p, sp) for p, sp, _ in requests]
        return [s.collect(1)[0][0].token_ids for s in streams], engine.stats()["steps_overlapped"] - before

    got, overlapped_steps = serve(overlapped)
    want, _ = serve(one_at_a_time)
    assert got == want
    assert overlapped_steps >= 10, overlapped_steps
