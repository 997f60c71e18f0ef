"""Prefix caching (kimi_jax/engine/prefix_cache.py, docs/serving.md "Prefix caching").

Host-side: the tree of shared pages and KDA checkpoints over a reference-counted ``BlockAllocator`` -- lookups find
the deepest checkpoint at or before the limit, pages are shared rather than copied, eviction takes the least recently
used page no sequence reads, the checkpoint cap drops the oldest and the pages only it kept.

Engine (the tiny model, float32): an answer served from cached prefixes equals the one an engine without the cache
gives -- a new question after a shared system prompt, a conversation turn after turn, a preempted sequence, a
request beside speculative decoding -- and the counters the server reports (``cached_tokens``, the Prometheus hit
counters) say what was reused.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kimi_jax.engine.prefix_cache import PrefixCache, checkpoint_interval
from kimi_jax.paged_cache import BlockAllocator

BT = 4  # tokens per page in the host-side tests


def _cache(num_blocks=16, max_checkpoints=8):
    alloc = BlockAllocator(num_blocks, block_tokens=BT)
    return alloc, PrefixCache(alloc, max_checkpoints=max_checkpoints)


def _run(alloc, owner, key, tokens):
    """A sequence that prefilled ``tokens`` ids of ``key`` into pages of its own."""
    alloc.allocate(owner, tokens)
    return alloc.blocks(owner)


# ================================================================================================== host side
def test_allocator_counts_holders_of_a_shared_page():
    alloc = BlockAllocator(8, block_tokens=BT)
    a = alloc.allocate("a", 8)
    alloc.share("b", a[:1])
    assert alloc.ref_count(a[0]) == 2 and alloc.ref_count(a[1]) == 1
    assert alloc.free("a") == 1  # a[1] goes back; a[0] is still read by "b"
    assert alloc.free_blocks == 6 and alloc.ref_count(a[0]) == 1
    assert alloc.free("b") == 1 and alloc.free_blocks == 7
    with pytest.raises(ValueError, match="not held"):
        alloc.share("c", [a[0]])


def test_lookup_returns_the_deepest_checkpoint_and_shares_its_pages():
    alloc, cache = _cache()
    key = list(range(100, 112))  # three pages
    blocks = _run(alloc, "s", key, 12)
    cache.store(key, 8, blocks, "state@8")
    cache.store(key, 12, blocks, "state@12")
    alloc.free("s")
    assert [alloc.ref_count(b) for b in blocks] == [1, 1, 1]  # the cache holds them now; nothing was copied

    m = cache.lookup(key + [7, 7], limit=13)
    assert (m.tokens, m.blocks, m.checkpoint, m.tail_block, m.matched) == (12, tuple(blocks), "state@12", None, 12)
    m = cache.lookup(key, limit=11)  # the limit (the prompt minus its last token) caps the hit
    assert (m.tokens, m.checkpoint, m.matched) == (8, "state@8", 8)
    m = cache.lookup(key[:10] + [0, 0], limit=12)  # parts in page 3: the page-2 checkpoint
    assert (m.tokens, m.blocks, m.matched) == (8, tuple(blocks[:2]), 8)
    m = cache.lookup(key[:6] + [0] * 6, limit=12)  # parts in page 2: full pages match up to 4, no checkpoint there
    assert (m.tokens, m.checkpoint, m.matched) == (0, None, 4)


def test_a_checkpoint_part_way_into_a_page_keeps_a_copy_of_that_page():
    alloc, cache = _cache()
    key = list(range(10))  # 2 full pages + 2 tokens
    blocks = _run(alloc, "s", key, 10)
    cache.store(key, 10, blocks, "state@10", tail_block=blocks[2])  # the sequence ends: its partial page handed over
    alloc.free("s")
    assert alloc.ref_count(blocks[2]) == 1
    m = cache.lookup(key + [5, 6], limit=11)
    assert (m.tokens, m.blocks, m.tail_block, m.checkpoint) == (10, tuple(blocks[:2]), blocks[2], "state@10")
    assert cache.lookup(key[:9] + [99, 5], limit=11).tokens == 0  # the tail's ids must match too
    with pytest.raises(ValueError, match="tail_block"):
        cache.store(list(range(50, 57)), 7, blocks, "x")


def test_eviction_takes_the_least_recently_used_page_no_sequence_reads():
    alloc, cache = _cache(num_blocks=7)  # 6 usable pages
    a, b = [1] * 8, [2] * 8
    for owner, key in (("a", a), ("b", b)):
        cache.store(key, 8, _run(alloc, owner, key, 8), f"state-{owner}")
        alloc.free(owner)
    assert alloc.free_blocks == 2
    cache.lookup(a, limit=9)  # "a" is now the most recently used
    hit = cache.lookup(b, limit=9)
    alloc.share("reader", hit.blocks)  # a running sequence reads b's pages
    assert cache.evict_lru()  # a's last page goes (b's are read); a's first page now leads nowhere and goes too
    assert alloc.free_blocks == 4 and cache.lookup(a, limit=9).tokens == 0
    assert not cache.evict_lru()  # only pages in use are left
    alloc.free("reader")
    assert cache.evict_lru() and alloc.free_blocks == 6 and len(cache) == 0


def test_the_checkpoint_cap_drops_the_oldest_and_the_pages_only_it_needed():
    alloc, cache = _cache(max_checkpoints=2)
    keys = [[i] * 8 for i in range(3)]
    for i, key in enumerate(keys):
        cache.store(key, 8, _run(alloc, i, key, 8), f"state-{i}")
        alloc.free(i)
    assert len(cache) == 2 and cache.lookup(keys[0], limit=9).tokens == 0
    assert cache.stats() == {"pages": 4, "reclaimable_pages": 4, "checkpoints": 2}
    assert alloc.free_blocks == 15 - 4


def test_passing_through_a_page_does_not_refresh_its_checkpoint():
    """Checkpoints age by their own use: storing a deeper one (a prompt's end, a finished turn) passes through the
    pages of shallower ones without making them recent, so the cap drops those first."""
    alloc, cache = _cache(max_checkpoints=2)
    key = list(range(20))
    blocks = _run(alloc, "s", key, 20)
    cache.store(key, 4, blocks, "state@4")
    cache.store(key, 10, blocks, "state@10", tail_block=blocks[2])
    cache.store(key, 16, blocks, "state@16")  # the cap: state@4 goes, not state@10
    assert cache.lookup(key, limit=11).checkpoint == "state@10"
    assert cache.lookup(key, limit=9).tokens == 0  # nothing at or before 9 but the dropped state@4


def test_checkpoints_cost_no_more_than_the_pages_they_skip():
    assert checkpoint_interval(state_bytes=100, block_bytes=200, most=64) == 1
    assert checkpoint_interval(state_bytes=1000, block_bytes=100, most=64) == 16
    assert checkpoint_interval(state_bytes=1000, block_bytes=100, most=8) == 8  # never past a sequence's pages
    # a model without MLA layers: its pages hold no bytes, so checkpoints fall only where prompts part / prefills end
    assert checkpoint_interval(state_bytes=1000, block_bytes=0, most=64) == 64
    # K3.1 (docs/serving.md): 428.6 MiB of KDA state per checkpoint, 1.04 MiB per fp8 page of every MLA layer
    from kimi_jax.cache import CacheLayout
    from kimi_jax.config import get_preset

    layout = CacheLayout(get_preset("kimi-k3.1-pro"), kv_dtype="fp8", index_dtype="fp8")
    assert checkpoint_interval(layout.state_bytes_per_sequence, layout.page_bytes, most=2 ** 14) == 512


# ================================================================================================== engine
def _prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 1000, n).tolist()


@pytest.fixture(scope="module")
def engines(served):
    """The shared engine's compiled runner under two more engines: one checkpointing every 4 pages (so that where a
    prompt leaves the cached pages matters), one without prefix caching (the reference)."""
    from kimi_jax.engine import Engine

    base = served.engine
    every4 = Engine(base.model, base.tokenizer, dataclasses.replace(base.config, prefix_checkpoint_blocks=4),
                    runner=base.runner).start()
    off = Engine(base.model, base.tokenizer, dataclasses.replace(base.config, prefix_caching=False),
                 runner=base.runner).start()
    yield every4, off
    every4.shutdown()
    off.shutdown()


def _answer(engine, ids, max_tokens=6):
    from kimi_jax.engine import SamplingParams

    outs, done = engine.submit(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                                   logprobs=True)).collect(1)
    return outs[0], done.num_cached_tokens


def _same(a, b):
    assert a.token_ids == b.token_ids
    np.testing.assert_allclose([t.logprob for t in a.logprobs], [t.logprob for t in b.logprobs], atol=2e-5)


def test_a_new_question_after_a_shared_system_prompt_resumes_where_the_prompts_part(engines):
    """Checkpoints every 4 pages (256 tokens): a 200-token system prompt holds none.  The first question caches its
    pages; the second matches three of them (192 tokens) without a checkpoint there, so it prefills from the start
    and leaves one at 192; the third resumes at 192.  Every answer equals the uncached engine's."""
    cached, off = engines
    system = _prompt(500, 200)
    questions = [system + _prompt(510 + i, 30) for i in range(3)]
    got = [_answer(cached, q) for q in questions]
    assert [c for _, c in got] == [0, 0, 192]
    for (out, _), q in zip(got, questions):
        _same(out, _answer(off, q)[0])
    st = cached.stats()
    assert st["prefix_checkpoint_blocks"] == 4 and st["prefix_cache_hits"] >= 1


@pytest.mark.parametrize("overlap", [True, False], ids=["async-scheduling", "one-step-at-a-time"])
def test_the_next_turn_of_a_conversation_reuses_the_prompt_and_the_answer(engines, overlap):
    """A finished sequence leaves a checkpoint after its last fed token: the next turn, which carries this turn's
    prompt and answer, resumes there, part-way into a page. With overlapped steps (async scheduling) the step after
    the last one was in flight and fed the answer's last token: prompt + answer tokens are cached; one step at a
    time that token was never fed: prompt + answer − 1."""
    from kimi_jax.engine import Engine

    every4, off = engines
    cached = Engine(every4.model, every4.tokenizer, every4.config, runner=every4.runner,
                    async_scheduling=overlap).start()
    try:
        conversation = _prompt(520, 90)
        for turn in range(3):
            out, n_cached = _answer(cached, conversation)
            _same(out, _answer(off, conversation)[0])
            if turn:
                assert n_cached == previous
            previous = len(conversation) + len(out.token_ids) - (0 if overlap else 1)
            conversation = conversation + out.token_ids + _prompt(530 + turn, 11)
        assert (cached.stats()["steps_overlapped"] > 0) == overlap
    finally:
        cached.shutdown()


def test_cached_pages_are_evicted_before_a_running_sequence_is_preempted(served, tiny_model):
    """A pool of 8 pages: two finished 150-token prompts stay cached; a sequence that grows to all 8 pages evicts
    them rather than waiting or being preempted, and its tokens are those of the uncached engine."""
    from kimi_jax.engine import Engine, EngineConfig

    cfg = EngineConfig(max_num_seqs=2, max_model_len=512, prefill_chunk_sizes=(64, 16), num_blocks=9)
    cached = Engine(tiny_model, served.tokenizer, cfg).start()
    off = Engine(tiny_model, served.tokenizer, dataclasses.replace(cfg, prefix_caching=False),
                 runner=cached.runner).start()
    try:
        for i in range(2):
            _answer(cached, _prompt(540 + i, 150), max_tokens=2)
        st = cached.stats()
        assert st["prefix_cache_blocks"] >= 6 and st["free_blocks"] + st["prefix_cache_blocks"] == 8
        long = _prompt(550, 300)
        out, _ = _answer(cached, long, max_tokens=200)  # 499 positions: 8 pages
        st = cached.stats()
        assert st["num_preemptions"] == 0
        assert all(cached.prefix_cache.lookup(_prompt(540 + i, 150), 149).tokens == 0 for i in range(2))  # evicted
        _same(out, _answer(off, long, max_tokens=200)[0])
    finally:
        cached.shutdown()
        off.shutdown()


def test_the_n_sequences_of_a_request_share_their_prompt_pages(served):
    """n = 3 over a 201-token prompt: one prefill of 192 tokens (three full pages), which the three sequences read
    in place; each holds only the page its own tokens go to (32 out: 233 positions, four pages each) -- 6 pages in
    use, not 12 -- and their answers are those of n = 1."""
    from kimi_jax.engine import SamplingParams

    engine = served.engine
    ids = _prompt(580, 201)
    p = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    stream = engine.submit(ids, p, n=3)
    held = None
    for ev in stream:
        if held is None and getattr(ev, "token_ids", None):
            st = engine.stats()
            held = st["used_blocks"] - st["prefix_cache_blocks"]
    outs = stream.done
    assert held == 6
    alone = engine.generate(ids, p)[0].token_ids
    assert outs.num_generated == [32, 32, 32]
    again = engine.generate(ids, p, n=3)
    assert [o.token_ids for o in again] == [alone] * 3


def test_usage_and_metrics_report_the_cached_tokens(served):
    """OpenAI's usage.prompt_tokens_details.cached_tokens and vLLM's prefix-cache counters, over HTTP."""
    import httpx

    ids = _prompt(560, 140)
    body = {"model": "tiny", "prompt": ids, "max_tokens": 2, "temperature": 0}
    usage = [httpx.post(served.base_url + "/completions", json=body, timeout=120).json()["usage"] for _ in range(2)]
    assert usage[0]["prompt_tokens_details"]["cached_tokens"] == 0
    # chunks of 64 and 16 prefill 128 of the 139 tokens before the last; the other 11 ride the decode steps, so the
    # prompt's own checkpoint sits at 128
    assert usage[1]["prompt_tokens_details"]["cached_tokens"] == 128
    metrics = httpx.get(served.url + "/metrics", timeout=30).text
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
              if line.startswith("vllm:prefix_cache_")}
    assert values["vllm:prefix_cache_hits_total"] >= 128
    assert values["vllm:prefix_cache_queries_total"] >= values["vllm:prefix_cache_hits_total"] + 140


def test_a_chat_conversation_reuses_each_turn_and_answers_as_without_the_cache(served, engines):
    """Over /v1/chat/completions, the history re-encoded by the chat template: each turn resumes at least where the
    previous turn's prefill ended (its prompt; the answer too where its text re-encodes to the same ids), and every
    answer equals the one a server without the prefix cache gives."""
    import httpx

    from kimi_jax.serve.app import build_app
    from kimi_jax.serve.server import ServerThread

    _, off = engines
    plain = ServerThread(build_app(off, served.tokenizer, model_name="tiny")).start()
    words = "time person year way day thing man world life hand part child eye woman place work week".split()
    rng = np.random.default_rng(570)
    try:
        histories = {served.url: [{"role": "system", "content": " ".join(rng.choice(words, 60))}]}
        histories[plain.url] = list(histories[served.url])
        previous = None
        for turn in range(3):
            user = {"role": "user", "content": " ".join(rng.choice(words, 8))}
            answers = {}
            for url, messages in histories.items():
                messages.append(user)
                r = httpx.post(url + "/v1/chat/completions", timeout=300, json={
                    "model": "tiny", "messages": messages, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
                    "chat_template_kwargs": {"thinking": False}}).json()
                assert "choices" in r, r
                answers[url] = (r["choices"][0]["message"]["content"], r["usage"])
                messages.append({"role": "assistant", "content": answers[url][0]})
            (text, usage), (plain_text, _) = answers[served.url], answers[plain.url]
            assert text == plain_text
            if previous is not None:  # chunks of 64 and 16: the previous prefill ended on a multiple of 16
                assert usage["prompt_tokens_details"]["cached_tokens"] >= (previous - 1) // 16 * 16
            previous = usage["prompt_tokens"]
    finally:
        plain.stop()
