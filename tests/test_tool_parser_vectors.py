"""Tool-call parsing against the cases of vLLM's own parser tests (tests/tool_parsers/test_kimi_k2_tool_parser.py and
test_kimi_k3_tool_parser.py): the same model outputs and the results vLLM expects, written here as our tokens --
control tokens as ids, text through the tokenizer -- and run through our parsers both at once and token by token.

Where we differ on purpose: text after a K2 tool section stays content here (vLLM drops it; OpenAI allows content
beside calls), and a call whose id does not parse comes back as content text rather than vanishing.
"""

from __future__ import annotations

import json

import pytest

from kimi_jax.serve.parsers import K3OutputParser, KimiLinearOutputParser, merge_deltas
from kimi_jax.tokenizer import Tokenizer

SB, SE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
TB, TE, AB = "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>"


def _fn(name, props):
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {
        p: {"type": "string"} for p in props}}}}


WEATHER, READ_FILE, BOOK_FLIGHT = _fn("get_weather", ["city", "unit"]), _fn("read_file", ["path"]), \
    _fn("book_flight", ["city"])


@pytest.fixture(scope="module")
def k2():
    return Tokenizer.tiny("k2")


def call(call_id, args):
    return [TB, f"{call_id} ", AB, args, TE]


def section(*calls):
    return [SB] + [p for c in calls for p in c] + [SE]


def ids(tok, parts):
    out = []
    for p in parts:
        out += [tok.special_tokens[p]] if p in tok.special_tokens else tok.encode(p)
    return out


def parse(tok, parts, tools=(), streaming=False, finish="stop"):
    """(content, [(id, name, arguments)]) -- at once, or token by token with the deltas merged back together."""
    p = KimiLinearOutputParser(tok, tools=tools)
    toks = ids(tok, parts)
    if not streaming:
        p.feed_many(toks)
        p.finish(finish)
        r = p.result()
        return r.content, [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in r.tool_calls]
    deltas = []
    for t in toks:
        deltas += p.feed(t)
    deltas += p.finish(finish)
    content, calls = "", {}
    for d in merge_deltas(deltas):
        content += d.get("content") or ""
        for tc in d.get("tool_calls", []):
            c = calls.setdefault(tc["index"], ["", "", ""])
            c[0] = tc.get("id") or c[0]
            c[1] += (tc.get("function") or {}).get("name") or ""
            c[2] += (tc.get("function") or {}).get("arguments") or ""
    return content, [tuple(calls[i]) for i in sorted(calls)]


CASES = {
    "single_tool_call": (["I'll check. "] + section(call("functions.get_weather:0", '{"city": "Beijing"}')),
                         "I'll check. ", [("get_weather", {"city": "Beijing"})]),
    "parallel_tool_calls": (["Compare weather. "] + section(call("functions.get_weather:0", '{"city": "Beijing"}'),
                                                            call("functions.get_weather:1", '{"city": "Shanghai"}')),
                            "Compare weather. ",
                            [("get_weather", {"city": "Beijing"}), ("get_weather", {"city": "Shanghai"})]),
    "three_tool_calls": (["Multiple tasks. "] + section(
        call("functions.get_weather:0", '{"city": "New York"}'), call("functions.get_news:1", '{"topic": "technology"}'),
        call("functions.send_email:2", '{"to": "user@example.com", "subject": "Daily Update"}')),
        "Multiple tasks. ", [("get_weather", {"city": "New York"}), ("get_news", {"topic": "technology"}),
                             ("send_email", {"to": "user@example.com", "subject": "Daily Update"})]),
    "angle_brackets_in_json": (["Process HTML. "] + section(call("functions.process_html:0",
                                                                 '{"html": "<div>content</div>"}')),
                               "Process HTML. ", [("process_html", {"html": "<div>content</div>"})]),
    "multiline_json": (["Formatted. "] + section(call("functions.process_data:0",
                                                      '{\n  "name": "test",\n  "value": 123\n}')),
                       "Formatted. ", [("process_data", {"name": "test", "value": 123})]),
    "no_functions_prefix": (["No prefix. "] + section(call("get_weather:0", '{"city": "Tokyo"}')),
                            "No prefix. ", [("get_weather", {"city": "Tokyo"})]),
    "empty_arguments": (["Empty args. "] + section(call("functions.test:0", "{}")), "Empty args. ", [("test", {})]),
}


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("case", sorted(CASES))
def test_k2_extraction(k2, case, streaming):
    parts, content, calls = CASES[case]
    got_content, got = parse(k2, parts, streaming=streaming)
    assert got_content == content
    assert [(name, json.loads(args)) for _, name, args in got] == calls
    for cid, _, _ in got:  # the model's own id is kept: NAME:IDX, with or without the functions. prefix
        assert cid.split(":")[-1].isdigit()
    if case == "single_tool_call":
        assert got[0][0] == "functions.get_weather:0"


def test_k2_no_tools_plain_text(k2):
    assert parse(k2, ["This is a test"]) == ("This is a test", [])


@pytest.mark.parametrize("streaming", [False, True])
def test_k2_invalid_json_still_extracted(k2, streaming):
    parts = ["Help. "] + section(call("functions.bad:0", '{"city": "Beijing"'),
                                 call("functions.good:1", '{"city": "Shanghai"}'))
    _, got = parse(k2, parts, streaming=streaming)
    assert [n for _, n, _ in got] == ["bad", "good"] and got[0][2] == '{"city": "Beijing"'


@pytest.mark.parametrize("streaming", [False, True])
def test_k2_id_without_index_is_no_call(k2, streaming):
    parts = ["Help. "] + section(call("functions.invalid.0", '{"city": "Beijing"}'),
                                 call("functions.valid:1", '{"city": "Shanghai"}'))
    content, got = parse(k2, parts, streaming=streaming)
    assert [n for _, n, _ in got] == ["valid"]
    assert content.startswith("Help. ") and "invalid.0" in content  # given back as text, not lost


@pytest.mark.parametrize("streaming", [False, True])
def test_k2_bare_counter_single_tool(k2, streaming):
    args = {"city": "Tokyo", "unit": "celsius"}
    content, got = parse(k2, ["Let me check. "] + section(call("0", json.dumps(args))), [WEATHER], streaming)
    assert content == "Let me check. "
    assert [(cid, n, json.loads(a)) for cid, n, a in got] == [("0", "get_weather", args)]
    _, got = parse(k2, ["Let me check. "] + section(call("0", '{"city": "Tokyo"')), [WEATHER], streaming)
    assert got == [("0", "get_weather", '{"city": "Tokyo"')]  # invalid JSON, still the only tool's call


@pytest.mark.parametrize("streaming", [False, True])
def test_k2_bare_counter_infers_the_tool_by_its_arguments(k2, streaming):
    args = {"city": "Tokyo", "unit": "celsius"}
    _, got = parse(k2, ["Let me check. "] + section(call("0", json.dumps(args))), [READ_FILE, WEATHER], streaming)
    assert [(cid, n, json.loads(a)) for cid, n, a in got] == [("0", "get_weather", args)]


@pytest.mark.parametrize("args", ['{"city": "Tokyo"}', '{"city": "Tokyo"'], ids=["ambiguous", "malformed_json"])
@pytest.mark.parametrize("streaming", [False, True])
def test_k2_bare_counter_dropped_when_unsafe(k2, args, streaming):
    _, got = parse(k2, ["Let me check. "] + section(call("0", args)), [WEATHER, BOOK_FLIGHT], streaming)
    assert got == []


def test_k2_streaming_edge_cases(k2):
    # arguments arriving in small pieces
    parts = ["Help. ", SB, TB, "functions.get_weather:0 ", AB, '{"ci', 'ty": "Be', 'ijing"}', " ", TE, SE]
    _, got = parse(k2, parts, streaming=True)
    assert [(n, json.loads(a)) for _, n, a in got] == [("get_weather", {"city": "Beijing"})]
    # noise between the section's begin and the call's begin does not leak
    content, got = parse(k2, ["Reasoning. ", SB, " spurious noise ", TB, "functions.test:0 ", AB, '{"k": "v"} ', TE,
                              SE], streaming=True)
    assert "spurious" not in content and len(got) == 1
    # an empty section
    assert parse(k2, ["Reasoning. ", SB, SE], streaming=True)[1] == []
    # cut by max_tokens inside the arguments: the call with what was written
    content, got = parse(k2, ["I'll check. ", SB, TB, "functions.get_weather:0 ", AB, '{"city": "Bei'],
                         streaming=True, finish="length")
    assert got == [("functions.get_weather:0", "get_weather", '{"city": "Bei')]
    assert all(m not in content for m in (SB, SE, TB, TE, AB))
    # text after the section: kept as content here (vLLM drops it)
    content, got = parse(k2, ["Before. "] + section(call("functions.get_weather:0", '{"city": "Tokyo"} '))
                         + [" After tools."], streaming=True)
    assert len(got) == 1 and content == "Before.  After tools."


@pytest.mark.parametrize("case", ["single_tool_call", "parallel_tool_calls", "no_functions_prefix"])
def test_k2_streaming_matches_at_once(k2, case):
    parts = CASES[case][0]
    a, b = parse(k2, parts), parse(k2, parts, streaming=True)
    assert a[0] == b[0] and [(n, json.loads(x)) for _, n, x in a[1]] == [(n, json.loads(x)) for _, n, x in b[1]]


def test_k3_content_stops_at_message_close():
    """vLLM's K3 case: a turn that ends in <|close|>message<|sep|> without closing its response block gives the
    content before it, the marker never leaks, streamed token by token or at once."""
    tok = Tokenizer.tiny()
    out = tok.encode("Hello") + [tok.token_id("<|close|>")] + tok.encode("message") + [tok.token_id("<|sep|>")]
    at_once = K3OutputParser(tok, thinking=False)
    at_once.feed_many(out)
    assert at_once.result().content == "Hello"
    p = K3OutputParser(tok, thinking=False)
    streamed = "".join(d.get("content") or "" for t in out for d in p.feed(t))
    streamed += "".join(d.get("content") or "" for d in p.finish())
    assert streamed == "Hello"
