"""Structured output through llguidance against the shared tiny server (serve_helpers): ``response_format``
json_object / json_schema (strict), vLLM's guided_json / guided_regex / guided_choice / guided_grammar and
``structured_outputs``, in chat (thinking on and off) and completions, streamed, with n > 1 and beside tools.  The
random tiny model follows no format by itself, so every valid result here is the grammar's doing.
"""

from __future__ import annotations

import json
import re

import httpx
import numpy as np
import pytest

from kimi_jax.engine import Engine, SamplingParams
from kimi_jax.serve.structured import GrammarSpec, StructuredGuideBuilder, request_grammar

MODEL = "tiny"
NO_THINK = {"chat_template_kwargs": {"thinking": False}}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 9},
                                           "metric": {"type": "boolean"}},
          "required": ["city", "days", "metric"], "additionalProperties": False}
STRICT = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def http(served):
    with httpx.Client(base_url=served.url, timeout=120) as c:
        yield c


def _chat(http, extra, status=200, msg="Weather?", **kw):
    body = {"model": MODEL, "messages": [{"role": "user", "content": msg}], "temperature": 0, "max_tokens": 80,
            **extra, **kw}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == status, r.text
    return r.json()


def _check_weather(text):
    doc = json.loads(text)
    assert set(doc) == {"city", "days", "metric"} and isinstance(doc["city"], str) and len(doc["city"]) <= 8
    assert isinstance(doc["days"], int) and 1 <= doc["days"] <= 9 and isinstance(doc["metric"], bool)


@pytest.mark.parametrize("think", [False, True])
def test_json_schema_strict_in_chat(http, think):
    out = _chat(http, {"response_format": STRICT, **({} if think else NO_THINK)}, max_tokens=120)
    ch = out["choices"][0]
    assert ch["finish_reason"] == "stop", ch
    _check_weather(ch["message"]["content"])
    if think:
        assert ch["message"]["reasoning_content"] is not None


def test_json_object_n3_sampled_and_streamed(http, served):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": 1.0, "seed": 3, "n": 3,
            "max_tokens": 60, "response_format": {"type": "json_object"}, **NO_THINK,
            "structured_outputs": None}
    full = http.post("/v1/chat/completions", json=body).json()
    texts = {}
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for ch in json.loads(line[6:])["choices"]:
                    texts[ch["index"]] = texts.get(ch["index"], "") + (ch["delta"].get("content") or "")
    for ch in full["choices"]:
        if ch["finish_reason"] == "stop":
            assert isinstance(json.loads(ch["message"]["content"]), dict)
        else:  # cut by max_tokens: still a prefix the grammar allowed
            assert ch["message"]["content"].startswith("{")
        assert texts[ch["index"]] == ch["message"]["content"]  # streamed the same (seeded)


def test_guided_choice_regex_grammar_and_structured_outputs(http):
    choice = _chat(http, {"guided_choice": ["sunny day", "rain", "snow"], **NO_THINK})
    assert choice["choices"][0]["message"]["content"] in ("sunny day", "rain", "snow")
    rx = _chat(http, {"guided_regex": r"[0-9]{3}-[a-c]{2}", **NO_THINK})
    assert re.fullmatch(r"[0-9]{3}-[a-c]{2}", rx["choices"][0]["message"]["content"])
    lark = 'start: "go " DIR\nDIR: "north" | "south"\n'
    gr = _chat(http, {"guided_grammar": lark, **NO_THINK})
    assert gr["choices"][0]["message"]["content"] in ("go north", "go south")
    gbnf = 'root ::= "x" [0-9] [0-9]'
    g2 = _chat(http, {"structured_outputs": {"grammar": gbnf}, **NO_THINK})
    assert re.fullmatch(r"x[0-9]{2}", g2["choices"][0]["message"]["content"])
    so = _chat(http, {"structured_outputs": {"json": SCHEMA}, **NO_THINK}, max_tokens=120)
    _check_weather(so["choices"][0]["message"]["content"])
    gj = _chat(http, {"guided_json": json.dumps(SCHEMA), **NO_THINK}, max_tokens=120)
    _check_weather(gj["choices"][0]["message"]["content"])


def test_completions_follow_the_grammar(http):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Answer:", "max_tokens": 80, "temperature": 0,
                                           "guided_json": SCHEMA}).json()
    ch = r["choices"][0]
    assert ch["finish_reason"] == "stop"
    _check_weather(ch["text"])


def test_with_tools_auto_the_answer_follows_the_format_or_a_tool_section_opens(http, served):
    """Beside tools (tool_choice auto) the response is either in the format or empty with a tool section after it:
    pushed off the empty route (a bias against <|close|>), the answer is the format."""
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    tok = served.tokenizer
    close, opener = tok.token_id("<|close|>"), tok.token_id("<|open|>")
    starts = [t for t in range(tok.num_ranks) if tok.token_bytes(t).startswith(b"{")]
    bias = {str(opener): -100, **{str(t): 60 for t in starts}}  # the JSON route, then no tool section
    out = _chat(http, {"response_format": STRICT, "tools": tools, "logit_bias": bias, **NO_THINK}, max_tokens=120)
    _check_weather(out["choices"][0]["message"]["content"])
    builder = StructuredGuideBuilder(request_grammar({"response_format": STRICT}), tok, served.engine.vocab_size,
                                     fmt="k3", tools=True)
    g = builder.build()
    assert g.constraint().allows(close, served.engine.class_masks)  # empty response allowed first
    g.advance(close)
    forced = []
    while (con := g.constraint()) is not None and len(con.ids) == 1:
        forced.append(con.ids[0])
        g.advance(con.ids[0])
    assert tok.decode(forced) == "response<|sep|><|open|>tools<|sep|>"


@pytest.mark.parametrize("extra,param", [
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_grammar": "start: undefined_rule\n"}, "guided_grammar"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs"),
    ({"response_format": STRICT, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": "required"}, "response_format"),
])
def test_bad_formats_are_400s(http, extra, param):
    err = _chat(http, extra, status=400)["error"]
    assert err["param"] == param, err


def test_grammar_masks_under_speculative_decoding(served, tiny_model):
    """An n-gram speculative engine (its own compile: the verify program) keeps the grammar: drafts are checked
    against each position's mask and forced tokens are drafted as certain."""
    # the settings of test_batch_invariance's float32 speculative engine: the compiled programs come from the cache
    eng = Engine(tiny_model, served.tokenizer, max_num_seqs=16, max_model_len=192, prefill_chunk_sizes=(16,),
                 speculative_tokens=3, speculative_adaptive=False).start()
    try:
        spec = request_grammar({"guided_json": SCHEMA})
        builder = StructuredGuideBuilder(spec, served.tokenizer, eng.vocab_size, fmt=None)
        prompt = served.tokenizer.encode('{"city":"Oslo","days":3,"metric":true} again: ')
        outs = eng.generate(prompt, SamplingParams(max_tokens=80, temperature=0.0), n=1,
                            guide_factory=builder.build)
        _check_weather(outs[0].text)
        assert eng.stats()["spec_verify_steps"] > 0
        plain = eng.generate(prompt, SamplingParams(max_tokens=5, temperature=0.0))
        assert plain[0].token_ids  # free rows still decode beside it
    finally:
        eng.shutdown()


def test_bitmask_constraint_reaches_the_sampler(served):
    """A mask that allows two tokens: the greedy engine picks one of them, whatever the model prefers."""
    from kimi_jax.engine.guide import Constraint, Guide

    V = served.engine.vocab_size
    allowed = [300, 301]
    bits = np.zeros(-(-V // 32), np.int32)
    for t in allowed:
        bits[t >> 5] |= np.int32(np.uint32(1 << (t & 31)).view(np.int32))

    class Two(Guide):
        def constraint(self):
            return Constraint(bits=bits)

    outs = served.engine.generate([5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0), guide_factory=Two)
    assert set(outs[0].token_ids) <= set(allowed)
    assert isinstance(GrammarSpec("x", "y"), GrammarSpec)


def test_forced_tool_call_nested_arguments_follow_their_schema(http):
    """tool_choice required / named: an object or array argument is written as JSON that follows its own schema."""
    tools = [{"type": "function", "function": {"name": "book", "parameters": {"type": "object", "properties": {
        "who": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                                 "age": {"type": "integer", "minimum": 0, "maximum": 99}},
                "required": ["name", "age"], "additionalProperties": False},
        "days": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 7}, "minItems": 1,
                 "maxItems": 3}},
        "required": ["who", "days"]}}}]
    out = _chat(http, {"tools": tools, "tool_choice": {"type": "function", "function": {"name": "book"}},
                       **NO_THINK}, max_tokens=150)
    ch = out["choices"][0]
    assert ch["finish_reason"] == "tool_calls", ch
    args = json.loads(ch["message"]["tool_calls"][0]["function"]["arguments"])
    assert set(args["who"]) == {"name", "age"} and len(args["who"]["name"]) <= 6 and 0 <= args["who"]["age"] <= 99
    assert 1 <= len(args["days"]) <= 3 and all(isinstance(d, int) and 1 <= d <= 7 for d in args["days"])
