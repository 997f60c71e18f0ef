"""DeepSeek-V3.2's chat format (``kimi_jax/serve/chat_dsv32.py``): the prompt as the model's release writes it, and the
DSML tool-call parser, fed at once and token by token, on the tiny "dsv32" tokenizer (its markers as control ids)."""

from __future__ import annotations

import json

import pytest

from kimi_jax.serve.chat import segments_to_text
from kimi_jax.serve.chat_dsv32 import (DSV32OutputParser, encode_chat_dsv32, render_call, render_chat_segments_dsv32,
                                       render_tools)
from kimi_jax.serve.formats import DeepSeekV32Format, chat_format_for
from kimi_jax.serve.parsers import merge_deltas
from kimi_jax.tokenizer import Tokenizer

D = "｜DSML｜"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.tiny("dsv32")


def text_of(tok, messages, tools=None, thinking=False):
    return segments_to_text(tok, render_chat_segments_dsv32(tok, messages, tools, thinking=thinking))


def test_plain_turns_thinking_off_and_on(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!", "reasoning_content": "greet"},
            {"role": "user", "content": "Bye"}]
    off = "<｜begin▁of▁sentence｜>Be brief.<｜User｜>Hi<｜Assistant｜></think>Hello!<｜end▁of▁sentence｜>" \
          "<｜User｜>Bye<｜Assistant｜></think>"
    assert text_of(tok, msgs) == off
    # thinking on: only the last user turn opens <think>; the earlier answer's reasoning is dropped
    assert text_of(tok, msgs, thinking=True) == off[: -len("</think>")] + "<think>"
    ids = encode_chat_dsv32(tok, msgs)
    assert ids[0] == tok.bos_id and tok.token_id("<｜Assistant｜>") in ids


def test_tools_calls_and_results(tok):
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "reasoning_content": "need data", "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city": "Paris", "days": 2}'}},
                {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Nice"}'}}]},
            {"role": "tool", "tool_call_id": "a", "content": "sunny"},
            {"role": "tool", "tool_call_id": "b", "content": "rain"}]
    want = ("<｜begin▁of▁sentence｜>\n\n" + render_tools(TOOLS)
            + "<｜User｜>Weather in Paris?<｜Assistant｜><think>need data</think>"
            + f"\n\n<{D}function_calls>\n"
            + f'<{D}invoke name="get_weather">\n<{D}parameter name="city" string="true">Paris</{D}parameter>\n'
            + f'<{D}parameter name="days" string="false">2</{D}parameter>\n</{D}invoke>\n'
            + f'<{D}invoke name="get_weather">\n<{D}parameter name="city" string="true">Nice</{D}parameter>\n'
            + f"</{D}invoke>\n</{D}function_calls><｜end▁of▁sentence｜>"
            + "\n\n<function_results>\n<result>sunny</result>\n<result>rain</result>\n</function_results>\n\n<think>")
    assert text_of(tok, msgs, TOOLS, thinking=True) == want
    assert render_tools(TOOLS).startswith("## Tools\n") and '"name": "get_weather"' in render_tools(TOOLS)
    with pytest.raises(ValueError, match="tool result"):
        text_of(tok, [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}])


def _parse(tok, text_parts, thinking=False, streaming=False, finish="stop"):
    ids = []
    for p in text_parts:
        ids += [tok.special_tokens[p]] if p in tok.special_tokens else tok.encode(p)
    p = DSV32OutputParser(tok, thinking=thinking, id_factory=iter(f"call_{i}" for i in range(9)).__next__)
    if streaming:
        deltas = [d for t in ids for d in p.feed(t)] + p.finish(finish)
        deltas = merge_deltas(deltas)
        content = "".join(d.get("content") or "" for d in deltas)
        reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
        calls = {}
        for d in deltas:
            for tc in d.get("tool_calls", []):
                c = calls.setdefault(tc["index"], ["", ""])
                c[0] += (tc.get("function") or {}).get("name") or ""
                c[1] += (tc.get("function") or {}).get("arguments") or ""
        return reasoning, content, [tuple(calls[i]) for i in sorted(calls)]
    p.feed_many(ids)
    p.finish(finish)
    r = p.result()
    return r.reasoning_content, r.content, [(c["function"]["name"], c["function"]["arguments"]) for c in r.tool_calls]


CALLS_TEXT = (f"\n\n<{D}function_calls>\n<{D}invoke name=\"get_weather\">\n"
              f"<{D}parameter name=\"city\" string=\"true\">Paris \"centre\"</{D}parameter>\n"
              f"<{D}parameter name=\"days\" string=\"false\">2</{D}parameter>\n"
              f"<{D}parameter name=\"opts\" string=\"false\">{{\"unit\": \"C\"}}</{D}parameter>\n</{D}invoke>\n"
              f"<{D}invoke name=\"get_time\">\n</{D}invoke>\n</{D}function_calls>")


@pytest.mark.parametrize("streaming", [False, True])
def test_parser_reasoning_content_and_calls(tok, streaming):
    reasoning, content, calls = _parse(tok, ["think about it", "</think>", "Let me look." + CALLS_TEXT,
                                             "<｜end▁of▁sentence｜>"], thinking=True, streaming=streaming)
    assert reasoning == "think about it" and content == "Let me look."
    assert [(n, json.loads(a)) for n, a in calls] == [
        ("get_weather", {"city": 'Paris "centre"', "days": 2, "opts": {"unit": "C"}}), ("get_time", {})]


@pytest.mark.parametrize("streaming", [False, True])
def test_parser_edge_cases(tok, streaming):
    # no calls: content only, newlines kept
    assert _parse(tok, ["a\n\nb", "<｜end▁of▁sentence｜>"], streaming=streaming) == ("", "a\n\nb", [])
    # a string="false" value that is no JSON is passed as a string
    bad = f"\n\n<{D}function_calls>\n<{D}invoke name=\"f\">\n<{D}parameter name=\"x\" string=\"false\">abc" \
          f"</{D}parameter>\n</{D}invoke>\n</{D}function_calls>"
    _, _, calls = _parse(tok, [bad], streaming=streaming)
    assert json.loads(calls[0][1]) == {"x": "abc"}
    # cut inside a parameter: the call is closed with the parameters completed so far
    cut = CALLS_TEXT[: CALLS_TEXT.index("<" + D + "parameter name=\"days\"") + 20]
    _, content, calls = _parse(tok, ["ok" + cut], streaming=streaming, finish="length")
    assert content == "ok" and calls == [("get_weather", calls[0][1])]
    assert json.loads(calls[0][1]) == {"city": 'Paris "centre"'}


def test_round_trip_through_encoder_and_parser(tok):
    args = {"city": "Oslo", "days": 3, "flags": [1, 2], "note": None}
    rendered = "\n\n" + f"<{D}function_calls>\n" + render_call("get_weather", args) + f"\n</{D}function_calls>"
    _, content, calls = _parse(tok, ["Sure." + rendered, "<｜end▁of▁sentence｜>"])
    assert content == "Sure." and calls[0][0] == "get_weather" and json.loads(calls[0][1]) == args


def test_format_is_picked_when_the_tokenizer_has_the_markers(tok):
    assert isinstance(chat_format_for("deepseek_v32", tok), DeepSeekV32Format)
    assert chat_format_for("deepseek_v32", Tokenizer.tiny()) is None  # a Kimi vocabulary: no chat format
    fmt = chat_format_for("deepseek_v32", tok)
    opts = fmt.options({"thinking": True}, None).with_tools(TOOLS, "auto")
    ids = fmt.encode([{"role": "user", "content": "x"}], TOOLS, opts)
    assert ids[-1] == tok.token_id("<think>")
    parser = fmt.new_parser(opts)
    parser.feed_many(tok.encode("hmm") + [tok.token_id("</think>")] + tok.encode("done"))
    r = parser.result()
    assert r.reasoning_content == "hmm" and r.content == "done"
