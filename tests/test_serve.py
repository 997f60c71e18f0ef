"""The OpenAI-compatible server, through the official ``openai`` client (and raw httpx for what the client cannot
send), against a live uvicorn server on a free 127.0.0.1 port (tests/serve_helpers.py; shared with test_engine.py).

max_tokens stay small: every decode step serves all 32 slots of the tiny model on CPU.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import string
import subprocess
import sys
import time

import httpx
import openai
import pytest

import serve_helpers
from kimi_jax.engine import Engine
from kimi_jax.serve.app import build_app
from kimi_jax.serve.chat import encode_chat
from kimi_jax.serve.formats import KimiLinearFormat, chat_format_for
from kimi_jax.serve.server import ServerThread
from kimi_jax.tokenizer import Tokenizer

MODEL = "tiny"
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                        "metric": {"type": "boolean"}},
                       "required": ["city", "days", "metric"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}},
]
NO_THINK = {"chat_template_kwargs": {"thinking": False}}


@pytest.fixture(scope="module")
def http(served):
    with httpx.Client(base_url=served.url, timeout=120) as c:
        yield c


def _msgs(text):
    return [{"role": "user", "content": text}]


def _stats(http):
    return http.get("/stats").json()


def _wait_idle(http, timeout=20.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        s = _stats(http)
        if s["free_slots"] == s["max_num_seqs"] and s["running_seqs"] == 0 and s["num_requests_waiting"] == 0:
            return s
        time.sleep(0.05)
    raise AssertionError(f"engine not idle: {_stats(http)}")


def _metric(text, name, labels=""):
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*{labels}[^}}]*\}} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else None


def _collect_stream(chunks):
    """Aggregate streamed chat chunks per choice: content, reasoning, tool calls, finish reason, usage."""
    out, usage = {}, None
    for ch in chunks:
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            o = out.setdefault(c.index, {"content": "", "reasoning": "", "calls": {}, "finish": None, "logprobs": []})
            d = c.delta
            o["content"] += d.content or ""
            o["reasoning"] += (d.model_extra or {}).get("reasoning_content") or ""
            for tc in d.tool_calls or []:
                call = o["calls"].setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = tc.id or call["id"]
                if tc.function is not None:
                    call["name"] += tc.function.name or ""
                    call["arguments"] += tc.function.arguments or ""
            if c.logprobs is not None and c.logprobs.content:
                o["logprobs"] += c.logprobs.content
            if c.finish_reason:
                o["finish"] = c.finish_reason
    return out, usage


# ================================================================================================== basics
def test_models_health_metrics_tokenize(client, http, served):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert http.get("/health").status_code == 200
    text = "héllo 世界 🙂 <|open|>"
    ids = http.post("/tokenize", json={"prompt": text}).json()
    assert ids["count"] == len(ids["tokens"]) and ids["max_model_len"] == serve_helpers.MAX_MODEL_LEN
    assert served.tokenizer.token_id("<|open|>") not in ids["tokens"]  # control tokens never come from text
    assert http.post("/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"] == text
    m = http.get("/metrics")
    assert m.status_code == 200
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
                 "kimi_jax:free_slots", "kimi_jax:xla_compilations_total"):
        assert name in m.text, name


def test_chat_non_stream_and_stream_agree(client, http):
    msgs = [{"role": "system", "content": "You are Kimi."}, {"role": "user", "content": "Say something."}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0, seed=1)
    ch = r.choices[0]
    assert r.object == "chat.completion" and ch.finish_reason in ("stop", "length")
    extra = ch.message.model_extra
    assert ch.message.role == "assistant"
    assert extra["reasoning"] == extra["reasoning_content"]
    n_prompt = http.post("/tokenize", json={"messages": msgs}).json()["count"]
    assert r.usage.prompt_tokens == n_prompt and r.usage.total_tokens == n_prompt + r.usage.completion_tokens
    assert 1 <= r.usage.completion_tokens <= 10
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0, seed=1,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    agg, usage = _collect_stream(chunks)
    assert agg[0]["content"] == (ch.message.content or "")
    assert agg[0]["reasoning"] == (extra["reasoning_content"] or "")
    assert agg[0]["finish"] == ch.finish_reason
    assert usage.prompt_tokens == n_prompt and usage.completion_tokens == r.usage.completion_tokens
    assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])


def test_thinking_switches(client, http):
    msgs = _msgs("Hi")
    on = http.post("/tokenize", json={"messages": msgs}).json()["tokens"]
    off = http.post("/tokenize", json={"messages": msgs, **NO_THINK}).json()["tokens"]
    effort_none = http.post("/tokenize", json={"messages": msgs, "reasoning_effort": "none"}).json()["tokens"]
    low = http.post("/tokenize", json={"messages": msgs, "reasoning_effort": "low"}).json()["tokens"]
    assert off == effort_none and on != off and low != on  # the thinking-effort message says "low" instead of "max"
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0, extra_body=NO_THINK)
    assert r.choices[0].message.model_extra["reasoning_content"] is None
    r2 = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0,
                                        reasoning_effort="high")
    assert r2.usage.prompt_tokens == len(http.post("/tokenize", json={"messages": msgs, "reasoning_effort": "high"})
                                         .json()["tokens"])


def test_unicode_round_trip(client):
    text = "Grüße, 世界! 🚀 ∑ café"
    r = client.completions.create(model=MODEL, prompt=text, max_tokens=3, temperature=0, echo=True)
    assert r.choices[0].text.startswith(text)
    r = client.chat.completions.create(model=MODEL, messages=_msgs(text), max_tokens=4, temperature=0)
    json.dumps(r.model_dump())  # whatever bytes the model produced, the response is valid JSON text


# ================================================================================================== sampling options
def test_n_logprobs_and_seed(client):
    msgs = _msgs("Pick a word.")
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, n=2, temperature=1.0, seed=42,
                                       logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 10
    for c in r.choices:
        lps = c.logprobs.content
        assert len(lps) == 5
        for lp in lps:
            assert lp.logprob <= 0 and len(lp.top_logprobs) == 3
            tops = [t.logprob for t in lp.top_logprobs]
            assert tops == sorted(tops, reverse=True) and lp.logprob <= tops[0] + 1e-6
            assert bytes(lp.bytes).decode("utf-8", "replace") == lp.token or lp.token.startswith("<|")
    again = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, n=2, temperature=1.0, seed=42,
                                           extra_body={"ignore_eos": True})
    texts = lambda resp: [(c.message.content, c.message.model_extra["reasoning_content"]) for c in resp.choices]
    assert texts(again) == texts(r)
    other = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, n=2, temperature=1.0, seed=43,
                                           extra_body={"ignore_eos": True})
    assert texts(other) != texts(r)
    greedy = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, temperature=0, logprobs=True,
                                            top_logprobs=1)
    for lp in greedy.choices[0].logprobs.content:
        assert lp.token == lp.top_logprobs[0].token


def test_completions_stop_strings_and_logprobs(client):
    prompt = "Stop strings cut the text"
    base = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True, "skip_special_tokens": True})
    text = base.choices[0].text
    # pick a stop string inside plain text of the output (not spanning a control token: compare without them)
    raw = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True, "skip_special_tokens": False}).choices[0].text
    runs = re.split(r"<\|[a-z_]+\|>|\[[A-Z]+\]|<\|reserved_token_\d+\|>", raw)
    stop = next(r[i: i + 2] for r in runs for i in range(1, len(r) - 2) if r[i: i + 2].strip() and "\ufffd" not in r[i: i + 2])
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == text[: text.index(stop)] and r.choices[0].finish_reason == "stop"
    # streamed, with stop string held back correctly
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=stop,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    # legacy logprobs
    r = client.completions.create(model=MODEL, prompt=[prompt, "Another"], max_tokens=4, temperature=0, logprobs=2,
                                  n=2, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3] and r.usage.completion_tokens == 16
    assert r.choices[0].text == r.choices[1].text  # greedy choices agree
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(t) <= 2 for t in lp.top_logprobs) and lp.text_offset[0] == 0


# ================================================================================================== tools
def test_tool_call_named_choice_non_stream_and_stream(client):
    kw = dict(model=MODEL, messages=_msgs("What is the weather in Paris?"), tools=TOOLS, temperature=0,
              max_tokens=200, tool_choice={"type": "function", "function": {"name": "get_weather"}}, extra_body=NO_THINK)
    r = client.chat.completions.create(**kw)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    (call,) = ch.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    assert list(args) == ["city", "days", "metric"]
    assert isinstance(args["city"], str) and isinstance(args["days"], int) and isinstance(args["metric"], bool)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    agg, _ = _collect_stream(chunks)
    assert agg[0]["finish"] == "tool_calls" and list(agg[0]["calls"]) == [0]
    streamed = agg[0]["calls"][0]
    assert streamed["name"] == "get_weather" and json.loads(streamed["arguments"]) == args
    n_arg_chunks = sum(1 for c in chunks for x in c.choices for t in (x.delta.tool_calls or []) if t.function.arguments)
    assert n_arg_chunks > 3  # arguments arrive as deltas, not in one piece


def test_tool_call_required_and_auto(client, http):
    r = client.chat.completions.create(model=MODEL, messages=_msgs("Time?"), tools=TOOLS, tool_choice="required",
                                       temperature=0.8, seed=3, max_tokens=200, extra_body=NO_THINK)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name in ("get_weather", "get_time")
    if call.function.name == "get_time":
        assert json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
    with_tools = http.post("/tokenize", json={"messages": _msgs("x"), "tools": TOOLS}).json()["count"]
    without = http.post("/tokenize", json={"messages": _msgs("x")}).json()["count"]
    assert with_tools > without
    r = client.chat.completions.create(model=MODEL, messages=_msgs("x"), tools=TOOLS, max_tokens=3, temperature=0)
    assert r.usage.prompt_tokens == with_tools  # auto: tools declared, output free
    r = client.chat.completions.create(model=MODEL, messages=_msgs("x"), tools=TOOLS, tool_choice="none",
                                       max_tokens=3, temperature=0)
    assert r.usage.prompt_tokens == without


def test_required_tool_call_with_thinking_cannot_end_without_the_call(client, http):
    """thinking on (the default): the reasoning may not end the message, and it gets at most half of max_tokens —
    even a model pushed hard towards <|end_of_msg|> (id from the tokenizer) answers with the call."""
    eos = http.post("/tokenize", json={"prompt": "<|end_of_msg|>"}).json()["tokens"]
    r = client.chat.completions.create(model=MODEL, messages=_msgs("Time?"), tools=TOOLS, temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}},
                                       max_tokens=120, logit_bias={str(eos[-1]): 100})
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1


def test_huge_top_k_means_off_and_the_engine_lives(client, http):
    kw = dict(model=MODEL, messages=_msgs("hi"), max_tokens=3, seed=1, temperature=0.7)
    big = client.chat.completions.create(**kw, extra_body={"top_k": 2 ** 31})
    off = client.chat.completions.create(**kw)
    assert big.choices[0].message.content == off.choices[0].message.content
    assert http.get("/health").status_code == 200


def test_a_refused_prompt_in_a_batch_leaves_nothing_running(client, http):
    with pytest.raises(openai.BadRequestError) as e:  # the third prompt is empty
        client.completions.create(model=MODEL, prompt=["hello", "hi", ""], max_tokens=400)
    assert "empty" in e.value.body["message"]
    _wait_idle(http, timeout=10.0)


def test_model_of_the_wrong_type_and_tokenize_like_chat(http):
    r = http.post("/v1/chat/completions", json={"model": 5, "messages": _msgs("x")})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    none = http.post("/tokenize", json={"messages": _msgs("x"), "tools": TOOLS, "tool_choice": "none"}).json()
    plain = http.post("/tokenize", json={"messages": _msgs("x")}).json()
    assert none["count"] == plain["count"]  # as chat completions: tool_choice "none" leaves the tools out


# ================================================================================================== concurrency
def _chunk_aligned_prompt(http, text: str) -> str:
    """Pad ``text`` until its chat prompt is 65 tokens: the first 64 are one prefill chunk and only the last token
    rides a decode step (a KDA chunk call costs the same for 16 or 64 tokens on CPU; keeps the 32 serial reference
    runs cheap)."""
    tok = Tokenizer.tiny()
    count = lambda t: len(encode_chat(tok, _msgs(t), thinking=False))
    t = text
    while count(t) < 64:
        t += " x"
    for tail in ("", " y", " .", " y.", " ok"):
        if count(t + tail) == 65:
            t += tail
            break
    assert http.post("/tokenize", json={"messages": _msgs(t), **NO_THINK}).json()["count"] == count(t)
    return t


def test_32_concurrent_streams_match_serial(client, served, http):
    prompts = [_chunk_aligned_prompt(http, f"Req {i}: {'abcdefghijklmnopqrstuvwxyz'[i % 26] * (1 + i % 5)}")
               for i in range(32)]
    before = _stats(http)["compilations"]

    async def one(ac, p):
        chunks = []
        stream = await ac.chat.completions.create(model=MODEL, messages=_msgs(p), max_tokens=6, temperature=0,
                                                  stream=True, extra_body=NO_THINK)
        async for c in stream:
            chunks.append(c)
        return chunks

    async def all_at_once():
        ac = openai.AsyncOpenAI(base_url=served.base_url, api_key="unused", max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(one(ac, p) for p in prompts))
        finally:
            await ac.close()

    results = asyncio.run(all_at_once())
    serial = [client.chat.completions.create(model=MODEL, messages=_msgs(p), max_tokens=6, temperature=0,
                                             extra_body=NO_THINK) for p in prompts]
    for chunks, ref in zip(results, serial):
        ids = {c.id for c in chunks}
        assert len(ids) == 1  # no chunk of another request
        agg, _ = _collect_stream(chunks)
        assert agg[0]["content"] == (ref.choices[0].message.content or "")
        assert agg[0]["finish"] == ref.choices[0].finish_reason
    assert len({c[0].id for c in results}) == 32
    assert _stats(http)["compilations"] == before
    _wait_idle(http)


# ================================================================================================== errors
@pytest.mark.parametrize("body,param", [
    ({"messages": [{"role": "user", "content": "x"}], "temperature": 5}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": 500}}, "logit_bias"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": []}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    # an image part whose data URL holds no image is refused, not dropped (tests/test_serve_images.py: the rest)
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                                {"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}]}]},
     "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
      "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"thinking": "yes"}},
     "chat_template_kwargs"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}}, "response_format"),
    # an int too large for a float: a 400, not an OverflowError's 500
    ({"messages": [{"role": "user", "content": "x"}], "temperature": 10 ** 400}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "presence_penalty": -10 ** 400}, "presence_penalty"),
    ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": 10 ** 400}}, "logit_bias"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {
        "name": "pick", "parameters": {"type": "object", "properties": {"v": {"enum": list(string.ascii_letters + string.digits + "!#$%&")}},
                                       "required": ["v"]}}}], "tool_choice": "required"}, "tools"),
])
def test_bad_parameters_get_400(client, body, param):
    known = {"messages", "temperature", "n", "top_p", "max_tokens", "logit_bias", "top_logprobs", "stream_options",
             "tools", "tool_choice", "reasoning_effort", "response_format", "presence_penalty"}
    kw = {k: v for k, v in body.items() if k in known}
    extra = {k: v for k, v in body.items() if k not in known}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, extra_body=extra or None, **kw)
    assert e.value.status_code == 400
    err = e.value.body
    assert set(err) >= {"message", "type", "param", "code"} and err["param"] == param and err["message"]


def test_malformed_json_too_long_and_unknown_model(http, client):
    for raw in (b"{not json", b"[1, 2]", b""):
        r = http.post("/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"})
        assert r.status_code == 400
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert r.json()["error"]["type"] == "invalid_request_error"
    long = "word " * 2000
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=_msgs(long), max_tokens=4)
    assert e.value.code == "context_length_exceeded" and "maximum context length" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=serve_helpers.MAX_MODEL_LEN)
    assert e.value.code == "context_length_exceeded" and e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:  # the error names the parameter the request used
        client.chat.completions.create(model=MODEL, messages=_msgs("hi"), max_completion_tokens=10 ** 12)
    assert e.value.code == "context_length_exceeded" and e.value.body["param"] == "max_completion_tokens"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4", messages=_msgs("x"), max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    r = http.get("/v1/nope")
    assert r.status_code == 404 and "error" in r.json()



def test_wrong_method_and_response_format_shape_and_errors_logged(http, caplog):
    r = http.get("/v1/chat/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"  # RFC 9110: a 405 names the allowed methods
    assert r.json()["error"]["code"] == "method_not_allowed" and "use POST" in r.json()["error"]["message"]
    with caplog.at_level(logging.INFO, logger="kimi_jax.serve"):
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": _msgs("x"), "max_tokens": 2,
                                                     "response_format": "text"})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "response_format" and err["code"] == "invalid_type"
    assert "object" in err["message"]
    # the access log says only "400"; the server's own log says why
    assert any("response_format" in rec.getMessage() and "400" in rec.getMessage() for rec in caplog.records)


# ================================================================================================== disconnects
def test_client_disconnect_mid_stream_frees_slot(http, served, caplog):
    caplog.set_level(logging.INFO, logger="kimi_jax.serve")
    _wait_idle(http)
    body = {"model": MODEL, "messages": _msgs("Talk for a long time."), "max_tokens": 400, "stream": True,
            "ignore_eos": True}
    running_at_disconnect = []
    # the tiny model can write all 400 tokens before a client starved of CPU (2 cores, 2 test workers) has read 4
    # lines; then there is nothing left to abort and the attempt says nothing: try again (rarely needed)
    for _attempt in range(3):
        with httpx.Client(base_url=served.url, timeout=60) as c:
            with c.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                lines = 0
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        lines += 1
                    if lines >= 4:
                        break
                running_at_disconnect.append(_stats(http)["running_seqs"])
        if running_at_disconnect[-1] == 1:
            break
        _wait_idle(http)
    assert running_at_disconnect[-1] == 1, running_at_disconnect
    s = _wait_idle(http)
    assert s["free_slots"] == serve_helpers.MAX_NUM_SEQS
    assert s["free_blocks"] + s["prefix_cache_blocks"] == s["total_blocks"]  # every page came back to the pool
    m = http.get("/metrics").text
    assert _metric(m, "vllm:num_requests_running") == 0
    assert _metric(m, "kimi_jax:free_slots") == serve_helpers.MAX_NUM_SEQS
    assert (_metric(m, "vllm:request_success_total", 'finished_reason="abort"') or 0) >= 1
    # a non-streaming client that gives up is noticed too
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 450, "ignore_eos": True},
                  timeout=1.0)
    _wait_idle(http)
    said = [rec.getMessage() for rec in caplog.records if "client disconnected" in rec.getMessage()]
    assert any("mid-stream" in m for m in said) and any("cmpl-" in m for m in said)  # both aborts are logged


# ================================================================================================== other front ends
def test_api_key_required(served):
    app = build_app(served.engine, served.tokenizer, model_name=MODEL, api_key="sk-test")
    srv = ServerThread(app).start()
    try:
        bad = openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            bad.models.list()
        assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
        r = httpx.post(srv.url + "/v1/chat/completions", json={"model": MODEL, "messages": _msgs("x")})
        assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_request_error"
        assert httpx.get(srv.url + "/health").status_code == 200
        good = openai.OpenAI(base_url=srv.url + "/v1", api_key="sk-test", max_retries=0)
        assert good.chat.completions.create(model=MODEL, messages=_msgs("x"), max_tokens=2).choices
    finally:
        srv.stop()


def test_kimi_linear_format_front_end(served):
    """A Kimi-Linear model is served with the <|im_*|> template and parser (picked from the architecture)."""
    k2 = Tokenizer.tiny("k2")
    assert isinstance(chat_format_for("kimi_linear", k2), KimiLinearFormat)
    assert chat_format_for("deepseek_v32", k2) is None
    app = build_app(served.engine, k2, model_name=MODEL, chat_format=KimiLinearFormat(k2))
    srv = ServerThread(app).start()
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        r = c.chat.completions.create(model=MODEL, messages=_msgs("hi"), tools=TOOLS, max_tokens=4, temperature=0)
        ids = httpx.post(srv.url + "/tokenize", json={"messages": _msgs("hi")}).json()["tokens"]
        assert k2.token_id("<|im_user|>") in ids and r.choices[0].message.role == "assistant"
        with pytest.raises(openai.BadRequestError):
            c.chat.completions.create(model=MODEL, messages=_msgs("hi"), tools=TOOLS, tool_choice="required",
                                      max_tokens=4)
    finally:
        srv.stop()


def test_engine_death_gives_503(served, tiny_model):
    eng = Engine(tiny_model, served.tokenizer, served.engine.config, runner=served.engine.runner).start()
    srv = ServerThread(build_app(eng, served.tokenizer, model_name=MODEL)).start()
    try:
        assert httpx.get(srv.url + "/health").status_code == 200

        def boom():
            raise RuntimeError("simulated device failure")

        eng._decode = boom  # a failed step: its request ends, the engine rebuilds its state and serves on
        r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_error"
        assert "simulated" not in r.text and eng.alive

        class Fatal(BaseException):  # what the engine does not recover from
            pass

        def fatal():
            raise Fatal("simulated fatal failure")

        eng._iterate = fatal
        deadline = time.monotonic() + 30
        while eng.alive:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        h = httpx.get(srv.url + "/health")
        assert h.status_code == 503 and h.json()["error"]["code"] == "engine_dead" and "simulated" not in h.text
        r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    finally:
        srv.stop()
        eng.shutdown()


# ================================================================================================== CLI
def test_attention_precision_follows_the_model_dtype_unless_named():
    """--attention-precision auto: bf16 products for a bfloat16 model (as its dtype asks; the prefill attention
    then runs on the tensor cores), float32 products for a float32 one; an explicit choice wins. The model it
    yields shares its parameters and runs its forward at that precision."""
    import jax.numpy as jnp

    from kimi_jax import load_model
    from kimi_jax.kernels import attention_precision
    from kimi_jax.serve.__main__ import build_parser

    assert attention_precision("auto", jnp.bfloat16) == "storage"
    assert attention_precision("auto", jnp.float32) == "exact"
    assert attention_precision("exact", jnp.bfloat16) == "exact"
    assert attention_precision("storage", jnp.float32) == "storage"
    assert build_parser().parse_args([]).attention_precision == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--attention-precision", "fast"])
    model = load_model("tiny")
    other = model.with_kernels(dataclasses.replace(model.kernels, dsa_precision="storage"))
    assert other.ctx.kernels.dsa_precision == "storage" and model.ctx.kernels.dsa_precision == "exact"
    assert other.params is model.params and other.ctx.mesh is model.ctx.mesh


def test_cli_help_and_refusals(capsys):
    r = subprocess.run([sys.executable, "-m", "kimi_jax.serve", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0
    for flag in ("--checkpoint", "--model", "--mesh", "--host", "--port", "--max-num-seqs", "--max-model-len",
                 "--kv-dtype", "--index-dtype", "--num-blocks", "--api-key", "--kernels",
                 "xla_force_host_platform_device_count"):
        assert flag in r.stdout
    from kimi_jax.serve.__main__ import main

    assert main(["--mesh", "4x2"]) == 2  # refused before any model is loaded
    err = capsys.readouterr().err
    assert "8 devices" in err and "XLA_FLAGS=--xla_force_host_platform_device_count=8" in err
    assert main(["--mesh", "banana"]) == 2 and "AxB" in capsys.readouterr().err
    assert main(["--kernels", "norm=reference,attention=gpu"]) == 2 and "kernel family 'attention'" in (
        capsys.readouterr().err)
    assert main(["--kernels", "moe=cuda"]) == 2 and "unknown moe backend 'cuda'" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # not a TCP port
        main(["--port", "99999"])
    assert "0–65535" in capsys.readouterr().err
    import socket

    with socket.socket() as taken:  # a port in use: refused before the model loads
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert main(["--port", str(taken.getsockname()[1])]) == 2
        assert "in use" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse refuses a format the paged cache does not have
        main(["--kv-dtype", "int4"])
    capsys.readouterr()
    # a pool too small for one full-length sequence: a clear error before anything is compiled or served (a key
    # format the model's index keys cannot take fails the same way: `test_paged_cache`; tiny's keys take them all)
    assert main(["--num-blocks", "3"]) == 2 and "cannot hold one sequence" in capsys.readouterr().err
    assert main(["--max-model-len", "0"]) == 2 and "max_model_len" in capsys.readouterr().err  # not "the default"
