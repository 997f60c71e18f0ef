"""The serving engine (kimi_jax/engine): continuous batching, chunked prefill, stop logic, guided decoding, aborts,
prefix snapshots and the no-recompilation guarantee -- on the tiny model, plus host-side units (output text with stop
strings, guides, the K3 tool-call guide).

The engine is shared with test_serve.py (tests/serve_helpers.py): 32 slots x 512 tokens, prefill chunks 64 and 16,
prefix cache of 4 entries.  Reference logits come from ``Model.logits`` on ``[1, 70]`` inputs, the shape test_model.py
already compiles.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import serve_helpers
from kimi_jax.engine import (Engine, EngineConfig, EngineDeadError, ParamError, SamplingParams, SeqEvent,
                             TokenSequenceGuide)
from kimi_jax.engine import compile_watch
from kimi_jax.engine.detok import OutputText
from kimi_jax.engine.guide import (ALL, DIGITS, NUMBER_START, ONLY_IDS, TEXT, Choice, Constraint, Forced, FreeUntil,
                                   ProgramGuide, Text, vocab_class_masks)
from kimi_jax.serve.chat import encode_chat, encode_chat_kimi_linear
from kimi_jax.serve.parsers import K3OutputParser, KimiLinearOutputParser, merge_deltas
from kimi_jax.serve.tool_guide import K3ToolCallGuideBuilder
from kimi_jax.tokenizer import Tokenizer

REF_LEN = 70


@pytest.fixture(scope="module")
def engine(served):
    return served.engine


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.tiny()


def _prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 1000, n).tolist()


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _feed(parser, pieces):
    out = []
    for p in pieces:
        out += parser.feed_text(p) if isinstance(p, str) else parser.feed_control(p)
    return out


# ================================================================================================== host-side units
def test_output_text_stop_strings_and_holdback(tok):
    ids = tok.encode("Hello wonderful world. Bye")
    ot = OutputText(tok, stop=("world",))
    emitted, hit = [], None
    for t in ids:
        pieces, hit = ot.push(t)
        emitted += pieces
        if hit:
            break
    assert hit == "world" and "".join(emitted) == "Hello wonderful "
    ot = OutputText(tok, stop=("world",), include_stop=True)
    emitted = []
    for t in ids:
        pieces, hit = ot.push(t)
        emitted += pieces
        if hit:
            break
    assert "".join(emitted) == "Hello wonderful world"
    # "w" at the end is held (it may start "world"), plain text is not
    ot = OutputText(tok, stop=("world",))
    out = []
    for t in tok.encode("a w"):
        out += ot.push(t)[0]
    assert "".join(out) == "a " and ot.finish() == ["w"]


def test_output_text_unicode_and_control_tokens(tok):
    text = "héllo 世界 🙂"
    ids = tok.encode(text)
    ot = OutputText(tok)
    pieces = []
    for t in ids:
        got, _ = ot.push(t)
        assert all("\ufffd" not in p for p in got if isinstance(p, str))
        pieces += got
    pieces += ot.push(tok.token_id("<|close|>"))[0]
    assert "".join(p for p in pieces if isinstance(p, str)) == text
    assert pieces[-1] == tok.token_id("<|close|>")
    # a stop string never matches across a control token
    ot = OutputText(tok, stop=("ab",))
    got = ot.push(tok.encode("a")[0])[0] + ot.push(tok.token_id("<|sep|>"))[0] + ot.push(tok.encode("b")[0])[0]
    assert got == ["a", tok.token_id("<|sep|>"), "b"] and ot.stopped is None


def test_guide_parts(tok):
    masks = vocab_class_masks(tok, 1024)
    assert masks[ALL].all() and not masks[ONLY_IDS].any()
    assert not masks[TEXT, 1000:].any() and masks[TEXT, :256].all()
    digits = [i for i in range(1000) if masks[DIGITS, i]]
    assert digits and all(tok.decode([i]).isdigit() for i in digits)
    assert all(not tok.decode([i]).startswith("0") for i in np.nonzero(masks[NUMBER_START])[0])
    g = ProgramGuide([Forced([5, 6]), Choice([([7, 8], [Forced([1])]), ([7, 9], [])]), Text(TEXT, [2], 3),
                      FreeUntil([4])])
    assert g.constraint() == Constraint(ONLY_IDS, (5,))
    g.advance(5)
    g.advance(6)
    assert g.constraint() == Constraint(ONLY_IDS, (7,))
    g.advance(7)
    assert g.constraint() == Constraint(ONLY_IDS, (8, 9))
    g.advance(8)
    assert g.constraint() == Constraint(ONLY_IDS, (1,))  # the branch's continuation
    g.advance(1)
    assert g.constraint() == Constraint(TEXT, (2,))
    for t in (60, 61, 62):
        g.advance(t)
    assert g.constraint() == Constraint(ONLY_IDS, (2,))  # max_tokens reached: the end id is forced
    g.advance(2)
    assert g.constraint() is None and not g.finished
    g.advance(9)
    g.advance(4)
    assert g.finished
    with pytest.raises(ValueError):
        Choice([([1, 2], []), ([1, 2, 3], [])])
    with pytest.raises(ValueError, match="branches 65 ways"):  # wider than the sampler's explicit ids, at any depth
        Choice([([7, i], []) for i in range(65)])


def _drive(guide, masks, rng, free_end: int):
    """Run a guide without a model: forced tokens as given, other choices at random among the allowed ones (an
    unconstrained step, or one that may end text with ``free_end``, emits it one time in ten, so reasoning ends)."""
    out = []
    while not guide.finished and len(out) < 500:
        c = guide.constraint()
        if (c is None or free_end in c.ids) and rng.random() < 0.1:
            t = free_end
        elif c is None:
            t = int(rng.integers(1000))
        else:
            allowed = list(c.ids) + list(np.nonzero(masks[c.vocab_class])[0])
            t = int(rng.choice(allowed))
        guide.advance(t)
        out.append(t)
    return out


@pytest.mark.parametrize("thinking", [False, True])
def test_k3_tool_guide_yields_parsable_calls(tok, thinking):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                         "metric": {"type": "boolean"}, "unit": {"enum": ["c", "f"]},
                                         "extra": {"type": "object"}},
        "required": ["city", "days", "metric", "unit"]}}},
             {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}]
    builder = K3ToolCallGuideBuilder(tok, tools, thinking=thinking)
    masks = vocab_class_masks(tok, 1024)
    rng = np.random.default_rng(0)
    for name in ("get_weather", "noop", None):
        ids = _drive(builder.build(name), masks, rng, tok.token_id("<|close|>"))
        assert ids[-1] == tok.eos_id
        p = K3OutputParser(tok, thinking=thinking)
        p.feed_many(ids)
        res = p.result()
        assert res.finish_reason == "tool_calls" and len(res.tool_calls) == 1
        call = res.tool_calls[0]["function"]
        args = json.loads(call["arguments"])
        if name is not None:
            assert call["name"] == name
        if call["name"] == "get_weather":
            assert list(args) == ["city", "days", "metric", "unit"]
            assert isinstance(args["city"], str) and isinstance(args["days"], int)
            assert isinstance(args["metric"], bool) and args["unit"] in ("c", "f")
        else:
            assert args == {}


def test_k3_tool_guide_reasoning_leaves_room_for_the_call(tok):
    """thinking on: reasoning that never ends by itself is closed when only the call's longest form still fits, so
    the whole answer — reasoning, call, end of message — is at most the request's max_tokens."""
    tools = [{"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"unit": {"enum": ["c", "f"]}, "n": {"type": "integer"}},
        "required": ["unit", "n"]}}}]
    masks = vocab_class_masks(tok, 1024)
    for max_tokens in (120, 300):  # the call itself takes ≈ 95 of the tiny tokenizer's tokens
        guide = K3ToolCallGuideBuilder(tok, tools, thinking=True, max_tokens=max_tokens).build(None)
        ids = _drive(guide, masks, np.random.default_rng(1), free_end=-1)  # the model never closes its reasoning
        assert ids[-1] == tok.eos_id and len(ids) <= max_tokens
        p = K3OutputParser(tok, thinking=True)
        p.feed_many(ids)
        assert p.result().finish_reason == "tool_calls"


# ================================================================================================== engine vs model
@pytest.mark.parametrize("prompt_len,gen", [(66, 4), (58, 12)])
def test_greedy_and_logprobs_match_full_forward(engine, tiny_model, prompt_len, gen):
    """66 = one 64-chunk + the last token via decode; 58 = three 16-chunks + 9 tail tokens via decode."""
    ids = _prompt(prompt_len, prompt_len)
    out = engine.generate(ids, SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True, logprobs=True,
                                              top_logprobs=3))[0]
    assert len(out.token_ids) == gen and out.finish_reason == "length"
    seq = ids + out.token_ids
    seq = (seq + [0] * REF_LEN)[:REF_LEN]
    ref = _log_softmax(tiny_model.logits(np.array([seq]))[0].astype(np.float64))
    pos = np.arange(prompt_len - 1, prompt_len - 1 + gen)
    np.testing.assert_array_equal(ref[pos].argmax(-1), out.token_ids)
    got = np.array([lp.logprob for lp in out.logprobs])
    np.testing.assert_allclose(got, ref[pos, out.token_ids], atol=2e-4, rtol=1e-4)
    for lp, p in zip(out.logprobs, pos):
        assert [t for t, _ in lp.top] == list(np.argsort(-ref[p])[:3])


def test_n_choices_share_prefill_and_sample_independently(engine):
    ids = _prompt(1, 30)
    p = SamplingParams(max_tokens=6, temperature=1.0, seed=7, ignore_eos=True)
    a = engine.generate(ids, p, n=3)
    b = engine.generate(ids, p, n=3)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert len({tuple(o.token_ids) for o in a}) > 1
    g = engine.generate(ids, p.replace(temperature=0.0), n=2)
    assert g[0].token_ids == g[1].token_ids


def test_seeded_output_independent_of_batch(engine):
    ids = _prompt(2, 20)
    p = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=99, ignore_eos=True)
    alone = engine.generate(ids, p)[0].token_ids
    others = [engine.submit(_prompt(100 + i, 10 + 7 * i), SamplingParams(max_tokens=12, temperature=1.0,
                                                                          ignore_eos=True)) for i in range(6)]
    mine = engine.submit(ids, p)
    together = mine.collect(1)[0][0].token_ids
    for s in others:
        s.collect(1)
    assert together == alone


def test_stop_token_ids_strings_and_lengths(engine, tok):
    ids = tok.encode("The engine stops where it is told to stop.")
    base = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ref = engine.generate(ids, base)[0]
    assert ref.finish_reason == "length" and len(ref.token_ids) == 12
    # stop token id: output ends at its first occurrence, the token is reported but not in the text
    k = next(i for i in range(3, 12) if not tok.is_special(ref.token_ids[i]))
    stop_tok = ref.token_ids[k]
    first = ref.token_ids.index(stop_tok)
    o = engine.generate(ids, base.replace(stop_token_ids=(stop_tok,)))[0]
    assert o.token_ids == ref.token_ids[: first + 1] and o.finish_reason == "stop" and o.stop_reason == stop_tok
    assert o.text == tok.decode(ref.token_ids[:first], skip_special=True)
    # stop string: text ends right before it (or after it with include_stop_str_in_output)
    text = ref.text
    runs, cur = [], ""  # text between control tokens (a stop string never spans one)
    for piece in ref.pieces:
        if isinstance(piece, str):
            cur += piece
        else:
            runs.append(cur)
            cur = ""
    runs.append(cur)
    stop = next(r[i: i + 3] for r in runs for i in range(1, len(r) - 3)
                if r[i: i + 3].strip() and "\ufffd" not in r[i: i + 3])
    cut = text.index(stop)
    o = engine.generate(ids, base.replace(stop=(stop,)))[0]
    assert o.text == text[:cut] and o.finish_reason == "stop" and o.stop_reason == stop
    o = engine.generate(ids, base.replace(stop=(stop,), include_stop_str_in_output=True))[0]
    assert o.text == text[: cut + len(stop)]
    # end of turn: forced by logit_bias; min_tokens holds it back; ignore_eos runs through it
    eos = tok.eos_id
    o = engine.generate(ids, SamplingParams(max_tokens=8, temperature=0.0, logit_bias={eos: 100.0}))[0]
    assert o.token_ids == [eos] and o.finish_reason == "stop" and o.text == "" and o.stop_reason is None
    o = engine.generate(ids, SamplingParams(max_tokens=8, temperature=0.0, logit_bias={eos: 100.0}, min_tokens=3))[0]
    assert len(o.token_ids) == 4 and o.token_ids[-1] == eos and eos not in o.token_ids[:3]
    o = engine.generate(ids, SamplingParams(max_tokens=5, temperature=0.0, logit_bias={eos: 100.0},
                                            ignore_eos=True))[0]
    assert o.token_ids == [eos] * 5 and o.finish_reason == "length"


def test_logit_bias_forces_tokens(engine):
    o = engine.generate(_prompt(3, 12), SamplingParams(max_tokens=6, temperature=0.8, logit_bias={500: 100.0}))[0]
    assert o.token_ids == [500] * 6


def test_cache_end_finishes_with_length(engine):
    L = serve_helpers.MAX_MODEL_LEN
    ids = _prompt(4, L - 7)  # chunks 7x64 + 3x16 = 496 tokens, then 8 through the decode step
    o = engine.generate(ids, SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))[0]
    assert len(o.token_ids) == 7 and o.finish_reason == "length"
    with pytest.raises(ValueError, match="max_model_len"):
        engine.submit(_prompt(4, L), SamplingParams())


def test_forced_k3_sequence_parses_into_tool_call(engine, tok):
    """Guided decoding (TokenSequenceGuide) forces the exact assistant turn encode_chat writes for a tool call; the
    engine's pieces go through K3OutputParser as the server does, streamed and aggregated."""
    args = {"city": "Paris", "days": 3, "units": ["c", "f"]}
    user = [{"role": "user", "content": "Weather in Paris?"}]
    turn = {"role": "assistant", "content": "",
            "tool_calls": [{"id": "c1", "type": "function",
                            "function": {"name": "get_weather", "arguments": json.dumps(args)}}]}
    prompt = encode_chat(tok, user, thinking=False)
    full = encode_chat(tok, user + [turn], thinking=False, add_generation_prompt=False)
    assert full[: len(prompt)] == prompt
    forced = full[len(prompt):]
    stream = engine.submit(prompt, SamplingParams(max_tokens=len(forced) + 10, temperature=1.0),
                           guide_factory=lambda: TokenSequenceGuide(forced), n=2)
    parsers = [K3OutputParser(tok, thinking=False) for _ in range(2)]
    deltas = [[], []]
    tokens = [[], []]
    for ev in stream:
        if isinstance(ev, SeqEvent):
            tokens[ev.index] += ev.token_ids
            deltas[ev.index] += _feed(parsers[ev.index], ev.pieces)
            if ev.finish_reason:
                assert ev.finish_reason == "stop"
                deltas[ev.index] += parsers[ev.index].finish("stop")
    for i in range(2):
        assert tokens[i] == forced
        res = parsers[i].result()
        assert res.finish_reason == "tool_calls" and res.content == ""
        assert [c["function"]["name"] for c in res.tool_calls] == ["get_weather"]
        assert json.loads(res.tool_calls[0]["function"]["arguments"]) == args
        merged = merge_deltas(deltas[i])
        calls = [d for d in merged if "tool_calls" in d]
        assert calls[0]["tool_calls"][0]["function"]["name"] == "get_weather"
        streamed = "".join(d["tool_calls"][0]["function"]["arguments"] for d in calls)
        assert json.loads(streamed) == args


def test_forced_reasoning_and_kimi_linear_format(engine, tok):
    # K3 with thinking: reasoning, then the answer
    turn = {"role": "assistant", "reasoning_content": "Think first.", "content": "Answer: 42 °C"}
    user = [{"role": "user", "content": "q"}]
    prompt = encode_chat(tok, user, thinking=True)
    full = encode_chat(tok, user + [turn], thinking=True, add_generation_prompt=False)
    assert full[: len(prompt)] == prompt  # the generation prompt ends inside the think block
    forced = full[len(prompt):]
    out = engine.generate(prompt, SamplingParams(max_tokens=64, temperature=0.0),
                          guide_factory=lambda: TokenSequenceGuide(forced))[0]
    p = K3OutputParser(tok, thinking=True)
    _feed(p, out.pieces)
    res = p.result()
    assert (res.reasoning_content, res.content, res.tool_calls) == ("Think first.", "Answer: 42 °C", [])
    # Kimi-Linear / K2 format (its control ids share the tiny block; the engine hands them over as ids)
    k2 = Tokenizer.tiny("k2")
    args = {"q": "x"}
    turn = {"role": "assistant", "content": "ok", "tool_calls": [
        {"id": "functions.search:0", "type": "function", "function": {"name": "search", "arguments": json.dumps(args)}}]}
    prompt = encode_chat_kimi_linear(k2, user)
    full = encode_chat_kimi_linear(k2, user + [turn], add_generation_prompt=False)
    forced = full[len(prompt):]
    assert forced[-1] == k2.token_id("<|im_end|>") and forced[-1] in engine.stop_ids
    out = engine.generate(prompt, SamplingParams(max_tokens=64, temperature=0.0),
                          guide_factory=lambda: TokenSequenceGuide(forced))[0]
    assert out.token_ids == forced
    p = KimiLinearOutputParser(k2)
    _feed(p, out.pieces)
    res = p.result()
    assert res.content == "ok" and res.tool_calls[0]["function"]["name"] == "search"
    assert json.loads(res.tool_calls[0]["function"]["arguments"]) == args


def test_abort_frees_slots_and_guide_failure_is_contained(engine):
    s = engine.submit(_prompt(5, 40), SamplingParams(max_tokens=400, temperature=1.0, ignore_eos=True))
    seen = 0
    for ev in s:
        if isinstance(ev, SeqEvent):
            seen += 1
            if seen == 3:
                engine.abort(s.request_id)
            if ev.finish_reason:
                assert ev.finish_reason == "abort"
    assert s.done.finish_reasons == ["abort"] and s.done.num_generated[0] < 400

    class Broken:
        finished = False

        def constraint(self):
            raise RuntimeError("bad guide")

        def advance(self, t):
            pass

    o = engine.generate(_prompt(6, 5), SamplingParams(max_tokens=5), guide_factory=Broken)[0]
    assert o.finish_reason == "abort"
    assert engine.alive

    def unbuildable():
        raise ValueError("no such tool")

    with pytest.raises(ParamError, match="no such tool"):  # refused at submit, never on the engine thread
        engine.submit(_prompt(6, 5), SamplingParams(max_tokens=2), guide_factory=unbuildable)
    assert engine.alive
    assert engine.generate(_prompt(6, 5), SamplingParams(max_tokens=2, ignore_eos=True))[0].finish_reason == "length"
    st = engine.stats()
    assert st["free_slots"] == st["max_num_seqs"] and st["running_seqs"] == 0


def test_abort_stops_a_long_prefill_at_its_next_chunk(engine, monkeypatch):
    """A client that disconnects while its long prompt is prefilling (nothing else running) frees the engine at the
    next chunk, not after the whole prompt (and no token is generated for it)."""
    ids = _prompt(11, 450)  # 449 prompt tokens before the last: 7 chunks of 64
    calls = []
    prefill = engine.runner.prefill

    def spy(*a, **kw):
        calls.append(1)
        if len(calls) == 1:
            engine.abort("abort-in-prefill")  # the disconnect arrives while the first chunk runs
        return prefill(*a, **kw)

    monkeypatch.setattr(engine.runner, "prefill", spy)
    s = engine.submit(ids, SamplingParams(max_tokens=5, ignore_eos=True), request_id="abort-in-prefill")
    evs = list(s)
    monkeypatch.undo()
    assert len(calls) == 1
    assert s.done.finish_reasons == ["abort"] and s.done.num_generated == [0]
    assert [e.finish_reason for e in evs if isinstance(e, SeqEvent)] in ([], ["abort"])
    st = engine.stats()
    assert st["free_slots"] == st["max_num_seqs"] and st["free_blocks"] + st["prefix_cache_blocks"] == st["total_blocks"]
    assert engine.generate(_prompt(6, 5), SamplingParams(max_tokens=2, ignore_eos=True))[0].finish_reason == "length"


def test_prefix_cache_snapshot_gives_identical_output(engine):
    ids = _prompt(7, 100)  # 99 tokens before the last: chunks 64 + 16 + 16 = 96, the snapshot; 3 ride the steps
    p = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    first, d1 = engine.submit(ids, p).collect(1)
    second, d2 = engine.submit(ids, p).collect(1)
    longer, d3 = engine.submit(ids + _prompt(8, 30), p).collect(1)  # 129 -> 96 from the snapshot + 2 x 16
    assert (d1.num_cached_tokens, d2.num_cached_tokens, d3.num_cached_tokens) == (0, 96, 96)
    assert first[0].token_ids == second[0].token_ids
    fresh = engine.generate(ids + _prompt(8, 30), p.replace(max_tokens=7))[0]  # evicts nothing needed: compare
    assert fresh.token_ids[:6] == longer[0].token_ids


def test_no_recompilation_across_varied_traffic(engine, tok):
    """After start-up the engine never compiles: prompts of many lengths (chunk boundaries and tails), n > 1,
    every sampling option, guides, stop strings, aborts -- all through the fixed set of programs."""
    before = compile_watch.compile_count()
    lengths = [1, 2, 3, 15, 16, 17, 33, 63, 64, 65, 81, 97, 130, 257]
    streams = []
    for i, n in enumerate(lengths):
        p = SamplingParams(max_tokens=3 + i % 4, temperature=[0.0, 0.7, 1.3][i % 3], top_p=[1.0, 0.8][i % 2],
                           top_k=[0, 5, 50][i % 3], min_p=[0.0, 0.05][i % 2], seed=i, presence_penalty=0.5 * (i % 2),
                           frequency_penalty=0.3, repetition_penalty=1.0 + 0.1 * (i % 3),
                           logit_bias={i: 2.0}, logprobs=bool(i % 2), top_logprobs=i % 5, stop=("zz",),
                           min_tokens=i % 2)
        guide = (lambda: TokenSequenceGuide([5, 6, 7])) if i % 4 == 0 else None
        streams.append(engine.submit(_prompt(200 + i, n), p, n=1 + i % 3, guide_factory=guide))
    victim = engine.submit(_prompt(300, 50), SamplingParams(max_tokens=300, ignore_eos=True))
    engine.abort(victim.request_id)
    for s in streams + [victim]:
        list(s)
    assert compile_watch.compile_count() == before
    assert engine.stats()["compilations"] == before


def test_engine_death_is_reported_and_runner_reusable(served, tiny_model):
    """A second engine over the same compiled programs (no compile). A step that raises ends its requests with
    `RequestFailedError` and the engine recovers; a loop that dies (a BaseException) is reported: streams raise
    and new submissions are refused."""
    import time

    from kimi_jax.engine.request import RequestFailedError

    before = compile_watch.compile_count()
    eng = Engine(tiny_model, served.tokenizer, served.engine.config, runner=served.engine.runner).start()
    assert compile_watch.compile_count() == before
    assert eng.generate(_prompt(9, 10), SamplingParams(max_tokens=2))[0].finish_reason == "length"

    def boom():
        raise RuntimeError("simulated device failure")

    eng._decode = boom
    with pytest.raises(RequestFailedError):
        list(eng.submit(_prompt(9, 10), SamplingParams(max_tokens=5)))
    del eng._decode  # the device works again: the engine took requests back after its probe step
    deadline = time.monotonic() + 120
    while not eng.healthy and time.monotonic() < deadline:
        time.sleep(0.05)
    assert eng.alive and eng.stats()["step_failures"] == 1
    assert eng.generate(_prompt(9, 10), SamplingParams(max_tokens=2))[0].finish_reason == "length"

    class Fatal(BaseException):
        pass

    def die():
        raise Fatal("simulated loop death")

    eng._decode = die
    s = eng.submit(_prompt(9, 10), SamplingParams(max_tokens=5))
    with pytest.raises(EngineDeadError):
        list(s)
    assert not eng.alive and "simulated" in repr(eng.error)
    with pytest.raises(EngineDeadError):
        eng.submit(_prompt(9, 10), SamplingParams(max_tokens=5))
    eng.shutdown()


# ================================================================================================== paged pool
def test_stats_report_pages_and_pool_is_full_again_after_abort(engine):
    """Pages are allocated as sequences grow and all come back on finish / abort (prefix snapshots aside)."""
    s = engine.submit(_prompt(10, 130), SamplingParams(max_tokens=400, temperature=1.0, ignore_eos=True))
    for i, ev in enumerate(s):
        if i == 70:  # 130 + 70 tokens: at least 4 pages
            st = engine.stats()
            assert st["used_blocks"] - st["prefix_cache_blocks"] >= 4
            engine.abort(s.request_id)
    st = engine.stats()
    assert st["block_tokens"] == 64 and st["kv_dtype"] == "fp32"  # auto: the tiny model's float32
    assert st["free_blocks"] + st["prefix_cache_blocks"] == st["total_blocks"]
    assert st["total_blocks"] == serve_helpers.MAX_NUM_SEQS * serve_helpers.MAX_MODEL_LEN // 64


def test_kv_dtype_selects_the_pool_format(tiny_model, tok):
    """--kv-dtype fp8 / nvfp4 pick quantised pools (checked abstractly: nothing is compiled here)."""
    import jax
    from kimi_jax.engine.runner import ModelRunner, resolve_kv_dtype
    from kimi_jax.quant import E4M3

    assert resolve_kv_dtype("auto", np.float32) == "fp32" and resolve_kv_dtype("bfloat16") == "bf16"
    with pytest.raises(ValueError, match="unknown kv dtype"):
        resolve_kv_dtype("int4")
    masks = vocab_class_masks(tok, 1024)
    for kv, latent in (("fp8", [E4M3]), ("nvfp4", [np.uint8, E4M3, E4M3])):
        r = ModelRunner(tiny_model, max_num_seqs=2, max_model_len=128, prefill_chunk_sizes=(64,), kv_dtype=kv,
                        class_masks=masks, stop_mask=np.zeros(1024, bool))
        assert r.spec.num_blocks == 1 + 2 * 2 and r.index_dtype == "fp8"
        state = jax.eval_shape(r._fns["zeros_state"])
        pools = [c for c in state.cache.layers if hasattr(c, "latent")]
        assert len(pools) == 2 and [a.dtype for a in pools[0].latent] == latent
        assert state.cache.block_tables.shape == (2, 2)
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        ModelRunner(tiny_model, max_num_seqs=2, max_model_len=128, prefill_chunk_sizes=(64,), num_blocks=2,
                    class_masks=masks, stop_mask=np.zeros(1024, bool))


def test_preemption_by_recompute_gives_identical_outputs(tiny_model, tok):
    """A pool of 6 pages for 4 slots of 256 tokens: concurrent requests run out of pages, the youngest sequences are
    evicted and recomputed later -- and every output equals the one the request gets alone (greedy, seeded
    sampling with penalties, n = 2 sharing one prefill)."""
    eng = Engine(tiny_model, tok, EngineConfig(max_num_seqs=4, max_model_len=256, prefill_chunk_sizes=(64,),
                                               num_blocks=7)).start()
    try:
        reqs = [(_prompt(20, 70), SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True), 1),
                (_prompt(21, 90), SamplingParams(max_tokens=90, temperature=0.0, frequency_penalty=0.5,
                                                 ignore_eos=True), 1),
                (_prompt(22, 100), SamplingParams(max_tokens=80, temperature=0.8, seed=3, presence_penalty=0.4,
                                                  ignore_eos=True), 1),
                (_prompt(23, 40), SamplingParams(max_tokens=60, temperature=1.0, seed=5, ignore_eos=True), 2)]
        alone = [[o.token_ids for o in eng.generate(ids, p, n=n)] for ids, p, n in reqs]
        assert eng.stats()["num_preemptions"] == 0
        streams = [eng.submit(ids, p, n=n) for ids, p, n in reqs]
        together = [[o.token_ids for o in s.collect(n)[0]] for s, (_, _, n) in zip(streams, reqs)]
        st = eng.stats()
        assert st["num_preemptions"] > 0
        assert together == alone
        assert st["free_blocks"] + st["prefix_cache_blocks"] == st["total_blocks"] == 6 and st["free_slots"] == 4
        with pytest.raises(Exception, match="cache pages"):
            eng.submit(_prompt(24, 200), SamplingParams(max_tokens=5), n=2)  # 2 x 4 pages > 6
        # overlapped steps (async scheduling) over the same compiled runner: the same tokens, and while a
        # preempted sequence waits for pages with a slot free, the steps of the others still overlap
        overlapped = Engine(tiny_model, tok, eng.config, runner=eng.runner, async_scheduling=True).start()
        try:
            streams = [overlapped.submit(ids, p, n=n) for ids, p, n in reqs]
            together = [[o.token_ids for o in s.collect(n)[0]] for s, (_, _, n) in zip(streams, reqs)]
            st = overlapped.stats()
        finally:
            overlapped.shutdown()
        assert together == alone
        # 136 of 215 steps overlapped when measured (59 while every waiting request forced a step at a time)
        assert st["num_preemptions"] > 0 and st["steps_overlapped"] >= 0.5 * st["num_steps"], st
    finally:
        eng.shutdown()


@pytest.mark.parametrize("kv_dtype", ["fp8", "nvfp4"])
def test_quantised_cache_serves_what_the_model_computes(tiny_model, tok, kv_dtype):
    """With `--kv-dtype fp8 / nvfp4` the engine really decodes from quantised pages (rows quantised on write,
    dequantised inside the attention ops): its greedy tokens and logprobs equal the model's own paged forward over a
    cache of the same format, and every token is one the float32 full forward also rates highly."""
    eng = Engine(tiny_model, tok, EngineConfig(max_num_seqs=2, max_model_len=128, prefill_chunk_sizes=(64,),
                                               kv_dtype=kv_dtype)).start()
    try:
        assert eng.stats()["kv_dtype"] == kv_dtype
        ids = _prompt(31, 64)  # one prefill chunk; positions 63..68 stay inside the 70-token full forward
        gen = 6
        out = eng.generate(ids, SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True, logprobs=True))[0]
    finally:
        eng.shutdown()
    assert len(out.token_ids) == gen and out.finish_reason == "length"
    got_lp = np.array([lp.logprob for lp in out.logprobs])

    # the same format through Model's paged API, one sequence
    cache = tiny_model.new_paged_cache(1, 128, kv_dtype=kv_dtype, index_dtype=eng.stats()["index_dtype"])
    logits, cache = tiny_model.prefill(np.array([ids]), cache=cache)
    step_logits = [np.asarray(logits[0, -1], np.float64)]
    for t in out.token_ids[:-1]:
        lg, cache = tiny_model.decode_step(cache, np.array([t]))
        step_logits.append(np.asarray(lg[0], np.float64))
    paged = _log_softmax(np.stack(step_logits))
    np.testing.assert_array_equal(paged.argmax(-1), out.token_ids)
    np.testing.assert_allclose(got_lp, paged[np.arange(gen), out.token_ids], atol=2e-4, rtol=1e-4)

    seq = (ids + out.token_ids + [0] * REF_LEN)[:REF_LEN]
    ref = _log_softmax(tiny_model.logits(np.array([seq]))[0].astype(np.float64))
    pos = np.arange(len(ids) - 1, len(ids) - 1 + gen)
    rank = (ref[pos] > ref[pos, out.token_ids][:, None]).sum(-1)  # tokens the fp32 forward prefers to ours
    # The random tiny model's next-token distributions are nearly flat (top-1 ≈ 2 %), so storage error reorders
    # near-ties: fp8 keeps every pick within the fp32 top 8, nvfp4 (≈ 4.5 bits per value) within its top 32 of 1024.
    # The larger moves come from the index keys: fp8 keys can flip a near-tied top-8 selection of the indexer
    # (this prompt's first pick: fp8 latent + bf16 keys keep the fp32 argmax; fp8 keys give its 6th, 0.67 nats down).
    assert rank.max() <= {"fp8": 7, "nvfp4": 31}[kv_dtype], rank


def test_prefix_snapshot_after_a_hit_is_keyed_by_the_tokens_it_holds(tiny_model, tok):
    """Chunk sizes 32 and 24 do not divide one another, so after a prefix-cache hit the rest of a prompt need not
    split into whole chunks: a 57-token prompt leaves a 56-token snapshot (32 + 24); a 65-token prompt that extends
    it plans 32 + 32 = 64 prefill tokens, reuses the 56 and has 8 left that no chunk fits -- they ride the decode
    steps.  The snapshot taken after that prefill holds 56 tokens and must be stored as such (not as the 64 planned):
    asking the 65-token prompt again gives the same greedy tokens, those of the full forward."""
    # 8 pages: room for the cached prefixes beside the running sequence (with the default 2 the running sequence
    # would evict the 56-token checkpoint this test asks for again)
    eng = Engine(tiny_model, tok, EngineConfig(max_num_seqs=1, max_model_len=128, prefill_chunk_sizes=(32, 24),
                                               num_blocks=9)).start()
    try:
        short = _prompt(40, 57)
        longer = short + _prompt(41, 8)
        p = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        _, d0 = eng.submit(short, p).collect(1)
        first, d1 = eng.submit(longer, p).collect(1)
        again, d2 = eng.submit(longer, p).collect(1)
    finally:
        eng.shutdown()
    assert (d0.num_cached_tokens, d1.num_cached_tokens, d2.num_cached_tokens) == (0, 56, 56)
    assert again[0].token_ids == first[0].token_ids
    seq = (longer + first[0].token_ids + [0] * REF_LEN)[:REF_LEN]
    ref = tiny_model.logits(np.array([seq]))[0]
    np.testing.assert_array_equal(ref[np.arange(64, 69)].argmax(-1), first[0].token_ids)
