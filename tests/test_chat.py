"""Chat prompt encoding (SPEC section 11) and the incremental output parsers."""

import itertools
import json
import random

import pytest

from kimi_jax.serve.chat import (
    encode_chat,
    encode_chat_kimi_linear,
    escape_attribute,
    normalize_reasoning_effort,
    render_chat_segments,
    render_chat_segments_kimi_linear,
    segments_to_ids,
    segments_to_text,
    unescape_attribute,
)
from kimi_jax.serve.parsers import K3OutputParser, KimiLinearOutputParser, merge_deltas
from kimi_jax.tokenizer import Tokenizer

O, C, S, E = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
K3_CONTROLS = {O, C, S, E}


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.tiny()


@pytest.fixture(scope="module")
def tok_k2():
    return Tokenizer.tiny("k2")


def golden(tokenizer, items, controls):
    """Expected segments from a readable list: control names become their ids, other strings stay text."""
    out = []
    for it in items:
        if it in controls:
            out.append(tokenizer.token_id(it))
        elif out and isinstance(out[-1], str):
            out[-1] += it
        else:
            out.append(it)
    return out


def elem(tag, body=None):
    """<|open|>tag<|sep|>body<|close|>name<|sep|> as a readable list."""
    name = tag.split(" ")[0]
    return [O, tag, S] + ([] if body is None else [body]) + [C, name, S]


def msg(attrs, body):
    return [O, "message " + attrs, S, body, C, "message", S, E]


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
TOOLS_JSON = json.dumps(TOOLS, separators=(",", ":"))

ARGS = {"city": "Paris", "days": 3, "x<y>&\"z\"": True}

CONVERSATION = [
    {"role": "system", "content": "You are Kimi."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "reasoning_content": "I should call the tool.",
        "content": "",
        "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(ARGS)}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_a", "content": '{"temp": 21}'},
    {"role": "assistant", "reasoning_content": "It is 21 degrees.", "content": "It is 21 °C."},
    {"role": "user", "content": "Thanks! <|open|>"},
]


def expected_k3(thinking, escape, keep):
    key = escape_attribute('x<y>&"z"') if escape else 'x<y>&"z"'
    if escape:
        assert key == "x&lt;y&gt;&amp;&quot;z&quot;"

    def think(text):
        if keep:
            return elem("think", text)
        return elem("think") if thinking else []

    items = []
    items += msg('role="system" type="tool-declare"', "# Tools\n" + TOOLS_JSON)
    if thinking:
        items += msg('role="system" type="thinking-effort"', "max")
    items += msg('role="system"', "You are Kimi.")
    items += msg('role="user"', "Weather in Paris?")
    items += [O, 'message role="assistant"', S]
    items += think("I should call the tool.")
    items += elem("response")
    items += [O, "tools", S, O, 'call tool="get_weather" index="1"', S]
    items += elem('argument key="city" type="string"', "Paris")
    items += elem('argument key="days" type="number"', "3")
    items += elem(f'argument key="{key}" type="boolean"', "true")
    items += [C, "call", S, C, "tools", S, C, "message", S, E]
    items += msg('role="tool" name="get_weather"', '{"temp": 21}')
    items += [O, 'message role="assistant"', S]
    items += think("It is 21 degrees.")
    items += elem("response", "It is 21 °C.")
    items += [C, "message", S, E]
    items += msg('role="user"', "Thanks! <|open|>")
    items += [O, 'message role="assistant"', S, O, "think" if thinking else "response", S]
    return items


@pytest.mark.parametrize(
    "thinking,escape,keep", list(itertools.product([True, False], [True, False], [False, True]))
)
def test_encode_chat_golden(tok, thinking, escape, keep):
    segs = render_chat_segments(
        tok, CONVERSATION, TOOLS, thinking=thinking, escape_attributes=escape, keep_past_reasoning=keep
    )
    want = golden(tok, expected_k3(thinking, escape, keep), K3_CONTROLS)
    assert segs == want
    ids = encode_chat(tok, CONVERSATION, TOOLS, thinking=thinking, escape_attributes=escape, keep_past_reasoning=keep)
    assert ids == segments_to_ids(tok, want)
    # control ids sit exactly where the segments put them; the user's "<|open|>" text is not a control id
    controls = [i for i in ids if tok.is_special(i)]
    assert controls == [s for s in want if isinstance(s, int)]
    assert tok.decode(ids) == segments_to_text(tok, want)
    tail = [tok.token_id(O)] + tok.encode("think" if thinking else "response") + [tok.token_id(S)]
    assert ids[-len(tail):] == tail


def test_encode_chat_exact_ids_around_controls(tok):
    ids = encode_chat(tok, [{"role": "user", "content": "hi"}], thinking=False)
    o, c, s, e = (tok.token_id(n) for n in (O, C, S, E))
    want = (
        [o] + tok.encode('message role="user"') + [s] + tok.encode("hi") + [c] + tok.encode("message") + [s, e]
        + [o] + tok.encode('message role="assistant"') + [s, o] + tok.encode("response") + [s]
    )
    assert ids == want
    assert ids[0] == 1003 and 1005 in ids and 1002 in ids


def test_reasoning_after_last_user_is_kept(tok):
    msgs = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "reasoning_content": "R1", "content": "", "tool_calls": [
            {"id": "1", "function": {"name": "f", "arguments": {}}}]},
        {"role": "tool", "tool_call_id": "1", "content": "ok"},
    ]
    text = segments_to_text(tok, render_chat_segments(tok, msgs))
    assert f"{O}think{S}R1{C}think{S}" in text
    assert f'{O}call tool="f" index="1"{S}{C}call{S}' in text
    assert f'{O}message role="tool" name="f"{S}ok' in text


def test_reasoning_effort(tok):
    text = segments_to_text(tok, render_chat_segments(tok, [{"role": "user", "content": "q"}], reasoning_effort="low"))
    assert f'{O}message role="system" type="thinking-effort"{S}low{C}message{S}{E}' in text
    assert normalize_reasoning_effort("medium") == "high"
    assert normalize_reasoning_effort(None) == "max"
    text = segments_to_text(tok, render_chat_segments(tok, [{"role": "user", "content": "q"}], reasoning_effort="none"))
    assert "thinking-effort" not in text and text.endswith(f"{O}response{S}")
    with pytest.raises(ValueError):
        normalize_reasoning_effort("extreme")


def test_bad_messages_raise(tok):
    with pytest.raises(ValueError, match="role"):
        encode_chat(tok, [{"role": "wizard", "content": "x"}])
    with pytest.raises(ValueError, match="image_url"):
        encode_chat(tok, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(ValueError, match="control token"):
        encode_chat(Tokenizer.tiny("k2"), [{"role": "user", "content": "x"}])
    ids = encode_chat(tok, [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert tok.decode(ids).count("ab") == 1


def test_attribute_escaping_round_trip():
    for s in ['a"b', "<&>", "plain", "&amp;", '&quot;"']:
        assert unescape_attribute(escape_attribute(s)) == s


# ---------------------------------------------------------------------------------------------------------------
# K3 output parser


USER = [{"role": "user", "content": "Plan my trip."}]
ASSISTANT = {
    "role": "assistant",
    "reasoning_content": "The user wants a trip plan… I need weather 🌦 and a search.\nLet me call two tools.",
    "content": "Here is what I found: 日本 is nice.",
    "tool_calls": [
        {
            "id": "x",
            "type": "function",
            "function": {
                "name": "get_weather",
                "arguments": json.dumps({"city": "Tōkyō \"central\"\n", "days": 4, "scale": 1.5}),
            },
        },
        {
            "id": "y",
            "type": "function",
            "function": {
                "name": "search",
                "arguments": json.dumps(
                    {"query": "hotels & <inns>", "filters": {"stars": [4, 5], "pool": True, "note": None}, "k": 10}
                ),
            },
        },
    ],
}


def model_output(tok, assistant, thinking=True, escape=True):
    prompt = encode_chat(tok, USER, TOOLS, thinking=thinking, escape_attributes=escape)
    full = encode_chat(tok, USER + [assistant], TOOLS, thinking=thinking, escape_attributes=escape,
                       add_generation_prompt=False)
    assert full[: len(prompt)] == prompt
    return full[len(prompt):]


def run_parser(parser, ids, finish_reason="stop"):
    deltas = []
    for i in ids:
        deltas.extend(parser.feed(i))
    deltas.extend(parser.finish(finish_reason))
    return deltas, parser.result()


def join_deltas(deltas):
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    calls = {}
    for d in deltas:
        for tc in d.get("tool_calls", []):
            c = calls.setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in tc:
                assert c["id"] is None
                c["id"], c["name"] = tc["id"], tc["function"]["name"]
            c["arguments"] += tc["function"].get("arguments", "")
    return reasoning, content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("escape", [True, False])
def test_k3_parser_round_trip(tok, escape):
    ids = model_output(tok, ASSISTANT, escape=escape)
    ids_iter = iter(f"call_{i}" for i in range(10))
    parser = K3OutputParser(tok, thinking=True, unescape_attributes=escape, id_factory=lambda: next(ids_iter))
    deltas, res = run_parser(parser, ids)
    assert parser.done
    reasoning, content, calls = join_deltas(deltas)
    assert reasoning == ASSISTANT["reasoning_content"] == res.reasoning_content
    assert content == ASSISTANT["content"] == res.content
    assert len(calls) == 2 == len(res.tool_calls)
    for got, agg, want in zip(calls, res.tool_calls, ASSISTANT["tool_calls"]):
        assert got["name"] == want["function"]["name"] == agg["function"]["name"]
        assert got["id"] == agg["id"]
        assert got["arguments"] == agg["function"]["arguments"]
        assert json.loads(got["arguments"]) == json.loads(want["function"]["arguments"])
    assert [c["id"] for c in calls] == ["call_0", "call_1"]
    assert res.finish_reason == "tool_calls"
    msg = res.to_openai()
    assert msg["role"] == "assistant" and msg["tool_calls"][1]["function"]["name"] == "search"
    # the first delta of a call carries index, id, type and name
    first = next(d for d in deltas if "tool_calls" in d)["tool_calls"][0]
    assert first["index"] == 0 and first["type"] == "function" and first["function"]["name"] == "get_weather"


def test_k3_parser_thinking_off_plain_answer(tok):
    asst = {"role": "assistant", "content": "Just text, no tools. 😀"}
    ids = model_output(tok, asst, thinking=False)
    deltas, res = run_parser(K3OutputParser(tok, thinking=False), ids)
    assert res.content == asst["content"] and res.reasoning_content == "" and res.tool_calls == []
    assert res.finish_reason == "stop"
    assert all("\ufffd" not in d.get("content", "") for d in deltas)
    assert res.to_openai() == {"role": "assistant", "content": asst["content"]}


def test_k3_parser_truncated_output_never_raises(tok):
    ids = model_output(tok, ASSISTANT)
    for n in range(len(ids) + 1):
        parser = K3OutputParser(tok, thinking=True)
        deltas, res = run_parser(parser, ids[:n], "length")
        reasoning, content, calls = join_deltas(deltas)
        assert (reasoning, content) == (res.reasoning_content, res.content)
        for c, agg in zip(calls, res.tool_calls):
            assert c["arguments"] == agg["function"]["arguments"]
            json.loads(c["arguments"])  # argument-form calls are closed into valid JSON
        assert res.finish_reason == "length"


def test_k3_parser_drops_tag_headers_cut_off_by_the_end_of_generation(tok):
    """A forced call cut short by max_tokens (seen through the server: content '<|close|>respon'): a tag header that
    generation ended inside is markup, not text — dropped; a call whose header was complete is closed as '{}'.
    The same header ended by the end-of-message token instead is malformed output and stays spelled out."""
    head = [C, "response", S, O, "tools", S]
    for parts, calls in (([C], []), ([C, "respon"], []), (head + [O, 'call tool="f" inde'], []),
                         (head + [O, 'call tool="f" index="1"', S, O, "argument"], [("f", {})]),
                         (head + [O, 'call tool="f" index="1"', S, O, 'argument key="x" type="integer"', S, "3"],
                          [("f", {"x": 3})])):
        parser = K3OutputParser(tok, thinking=False)
        deltas = []
        for p in parts:
            deltas += parser.feed(tok.token_id(p)) if p in K3_CONTROLS else sum((parser.feed(i)
                                                                                 for i in tok.encode(p)), [])
        deltas += parser.finish("length")
        res = parser.result()
        assert res.content == "" and join_deltas(deltas)[1] == "", parts
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in res.tool_calls] == calls
        assert res.finish_reason == "length"
    parser = K3OutputParser(tok, thinking=False)
    for p in (C, "respon"):
        parser.feed(tok.token_id(p)) if p in K3_CONTROLS else [parser.feed(i) for i in tok.encode(p)]
    parser.feed(tok.token_id(E))
    assert parser.result().content == "<|close|>respon"


def test_k3_parser_arguments_are_strict_json(tok):
    """NaN / Infinity are Python's JSON extensions, not JSON: a number argument written as NaN comes back as the
    string "NaN", and a json-form body holding NaN is not taken as arguments."""
    parts = [O, "response", S, C, "response", S, O, "tools", S,
             O, 'call tool="f" index="1"', S, O, 'argument key="x" type="number"', S, "NaN", C, "argument", S,
             O, 'argument key="y" type="number"', S, "-Infinity", C, "argument", S, C, "call", S,
             O, 'call tool="g" index="2"', S, O, 'json type="object"', S, '{"a": NaN}', C, "json", S, C, "call", S,
             C, "tools", S, C, "message", S, E]
    _, res = feed_k3_text(tok, K3OutputParser(tok, thinking=False), parts)
    assert [c["function"]["name"] for c in res.tool_calls] == ["f"]
    assert res.tool_calls[0]["function"]["arguments"] == '{"x":"NaN","y":"-Infinity"}'
    assert '{"a": NaN}' in res.content  # the json-form call falls back to text


def test_kimi_linear_parser_drops_a_call_id_cut_off_by_the_end_of_generation(tok_k2):
    parser = KimiLinearOutputParser(tok_k2)
    for p in ("Hi", "<|tool_calls_section_begin|>", "<|tool_call_begin|>", "functions.get_wea"):
        ids = [tok_k2.token_id(p)] if p.startswith("<|") else tok_k2.encode(p)
        for i in ids:
            parser.feed(i)
    parser.finish("length")
    res = parser.result()
    assert res.content == "Hi" and res.tool_calls == [] and res.finish_reason == "length"


def feed_k3_text(tok, parser, parts):
    """parts: control names and text pieces."""
    deltas = []
    for p in parts:
        if p in K3_CONTROLS:
            deltas += parser.feed(tok.token_id(p))
        else:
            for i in tok.encode(p):
                deltas += parser.feed(i)
    deltas += parser.finish()
    return deltas, parser.result()


def test_k3_parser_json_form(tok):
    parts = ["ok", C, "think", S, O, "response", S, C, "response", S, O, "tools", S,
             O, 'call tool="f" index="1"', S, O, 'json type="object"', S, '{"a": [1, 2], "b": "x"}', C, "json", S,
             C, "call", S, C, "tools", S, C, "message", S, E]
    deltas, res = feed_k3_text(tok, K3OutputParser(tok), parts)
    assert res.reasoning_content == "ok"
    assert len(res.tool_calls) == 1
    assert json.loads(res.tool_calls[0]["function"]["arguments"]) == {"a": [1, 2], "b": "x"}
    assert join_deltas(deltas)[2][0]["arguments"] == res.tool_calls[0]["function"]["arguments"]


def test_k3_parser_call_cut_inside_its_json_gives_back_only_what_was_written(tok):
    """Generation ends inside a json-form call: the call fails and its text comes back as content exactly as the
    model wrote it — without the closing tags that the end of generation implied."""
    parts = [O, "response", S, "A", O, 'call tool="f" index="1"', S, O, 'json type="object"', S, '{"a": 1']
    deltas, res = feed_k3_text(tok, K3OutputParser(tok, thinking=False), parts)
    assert res.tool_calls == []
    assert res.content == 'A<|open|>call tool="f" index="1"<|sep|><|open|>json type="object"<|sep|>{"a": 1'
    assert join_deltas(deltas)[1] == res.content


def test_k3_parser_malformed_calls_fall_back_to_content(tok):
    parts = [O, "response", S, "A", C, "response", S, O, "tools", S,
             O, 'call index="1"', S, O, 'argument key="k"', S, "v", C, "argument", S, C, "call", S,
             O, 'call tool="g" index="2"', S, O, 'json type="object"', S, "{not json", C, "json", S, C, "call", S,
             O, 'call tool="h" index="3"', S, O, 'argument key="n" type="number"', S, "12x", C, "argument", S,
             C, "call", S, C, "tools", S, C, "message", S, E]
    deltas, res = feed_k3_text(tok, K3OutputParser(tok, thinking=False), parts)
    assert res.content.startswith("A")
    assert 'call index="1"' in res.content and "{not json" in res.content
    assert [c["function"]["name"] for c in res.tool_calls] == ["h"]
    assert json.loads(res.tool_calls[0]["function"]["arguments"]) == {"n": "12x"}
    assert join_deltas(deltas)[1] == res.content


def test_k3_parser_random_ids_never_raise(tok):
    rng = random.Random(1)
    controls = [tok.token_id(n) for n in (O, C, S)]
    words = [tok.encode(w) for w in ["think", "response", "tools", 'call tool="f"', 'argument key="a"',
                                     'argument key="b" type="number"', "json", "message", "1", '{"x":', "é"]]
    for trial in range(30):
        ids = []
        for _ in range(300):
            r = rng.random()
            if r < 0.3:
                ids.append(rng.choice(controls))
            elif r < 0.7:
                ids.extend(rng.choice(words))
            else:
                ids.append(rng.randrange(0, 1024))
        parser = K3OutputParser(tok, thinking=bool(trial % 2))
        deltas, res = run_parser(parser, ids)
        reasoning, content, calls = join_deltas(merge_deltas(deltas))
        assert (reasoning, content) == (res.reasoning_content, res.content)
        assert [c["arguments"] for c in calls] == [c["function"]["arguments"] for c in res.tool_calls]


def test_k3_parser_text_pieces_api(tok):
    p = K3OutputParser(tok, thinking=True)
    out = p.feed_text("hmm")
    out += p.feed_control(C) + p.feed_text("think") + p.feed_control(S)
    out += p.feed_control(O) + p.feed_text("response") + p.feed_control(tok.token_id(S)) + p.feed_text("yes")
    out += p.feed_control(E) + p.feed_text("ignored after end")
    res = p.result()
    assert (res.reasoning_content, res.content) == ("hmm", "yes")
    assert out == [{"reasoning_content": "hmm"}, {"content": "yes"}]


def test_k3_parser_text_between_calls_does_not_depend_on_how_it_was_cut(tok):
    """Text written inside ``tools`` between calls: all-whitespace is dropped, anything else is content, whole --
    whether it arrives as one piece, per token or per character."""
    def parse(text_pieces):
        p = K3OutputParser(tok, thinking=False, id_factory=lambda: "call_0")
        p.feed_control(O); p.feed_text("tools"); p.feed_control(S)
        for t in text_pieces:
            p.feed_text(t)
        p.feed_control(O); p.feed_text('call tool="f" index="1"'); p.feed_control(S)
        p.feed_control(C); p.feed_text("call"); p.feed_control(S)
        p.feed_control(C); p.feed_text("tools"); p.feed_control(S)
        p.feed_control(E)
        return p.result()

    for text, want in (("  a", "  a"), (" \n ", "")):
        for pieces in ([text], list(text), [tok.decode([i]) for i in tok.encode(text)]):
            res = parse(pieces)
            assert res.content == want, pieces
            assert [c["function"]["arguments"] for c in res.tool_calls] == ["{}"]


def test_k3_tool_guide_writes_each_enum_value_with_its_own_type(tok):
    """A forced call (tool_choice) over ``enum: ["auto", 3, true, null]`` may write exactly what ``encode_chat`` writes for
    each value -- ``type="number"`` for 3, ``type="null"`` for null -- so the parsed arguments keep the JSON types."""
    from kimi_jax.engine.guide import vocab_class_masks
    from kimi_jax.serve.tool_guide import K3ToolCallGuideBuilder

    tools = [{"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"v": {"enum": ["auto", 3, True, None]}}, "required": ["v"]}}}]
    masks = vocab_class_masks(tok, tok.vocab_size)
    for value in ("auto", 3, True, None):
        call = {"id": "c", "type": "function", "function": {"name": "pick", "arguments": json.dumps({"v": value})}}
        want = model_output(tok, {"role": "assistant", "content": "", "tool_calls": [call]}, thinking=False)
        guide = K3ToolCallGuideBuilder(tok, tools, thinking=False).build("pick")
        for t in want:
            assert not guide.finished and guide.constraint().allows(t, masks), (value, tok.decode(want))
            guide.advance(t)
        assert guide.finished
        p = K3OutputParser(tok, thinking=False)
        p.feed_many(want)
        assert json.loads(p.result().tool_calls[0]["function"]["arguments"]) == {"v": value}


# ---------------------------------------------------------------------------------------------------------------
# Kimi-Linear / K2 format


K2_CONTROLS = {"<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>",
               "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
               "<|tool_call_argument_begin|>", "<|tool_call_end|>"}


def test_encode_chat_kimi_linear_golden(tok_k2):
    segs = render_chat_segments_kimi_linear(tok_k2, CONVERSATION, TOOLS)
    items = ["<|im_system|>", "tool_declare", "<|im_middle|>", TOOLS_JSON, "<|im_end|>",
             "<|im_system|>", "system", "<|im_middle|>", "You are Kimi.", "<|im_end|>",
             "<|im_user|>", "user", "<|im_middle|>", "Weather in Paris?", "<|im_end|>",
             "<|im_assistant|>", "assistant", "<|im_middle|>", "<|tool_calls_section_begin|>",
             "<|tool_call_begin|>", "functions.get_weather:0", "<|tool_call_argument_begin|>", json.dumps(ARGS),
             "<|tool_call_end|>", "<|tool_calls_section_end|>", "<|im_end|>",
             "<|im_system|>", "tool", "<|im_middle|>", '## Return of functions.get_weather:0\n{"temp": 21}', "<|im_end|>",
             "<|im_assistant|>", "assistant", "<|im_middle|>", "It is 21 °C.", "<|im_end|>",
             "<|im_user|>", "user", "<|im_middle|>", "Thanks! <|open|>", "<|im_end|>",
             "<|im_assistant|>", "assistant", "<|im_middle|>"]
    assert segs == golden(tok_k2, items, K2_CONTROLS)
    kept = segments_to_text(tok_k2, render_chat_segments_kimi_linear(tok_k2, CONVERSATION, keep_past_reasoning=True,
                                                                      thinking=True))
    assert "<|im_middle|><think>I should call the tool.</think><|tool_calls_section_begin|>" in kept
    assert kept.endswith("<|im_assistant|>assistant<|im_middle|><think>")
    ids = encode_chat_kimi_linear(tok_k2, CONVERSATION, TOOLS)
    assert tok_k2.decode(ids) == segments_to_text(tok_k2, segs)


def test_kimi_linear_parser_round_trip(tok_k2):
    prompt = encode_chat_kimi_linear(tok_k2, USER, TOOLS)
    full = encode_chat_kimi_linear(tok_k2, USER + [ASSISTANT], TOOLS, add_generation_prompt=False)
    assert full[: len(prompt)] == prompt
    ids = full[len(prompt):]
    parser = KimiLinearOutputParser(tok_k2)
    deltas, res = run_parser(parser, ids)
    assert parser.done
    reasoning, content, calls = join_deltas(deltas)
    assert reasoning == ASSISTANT["reasoning_content"] == res.reasoning_content
    assert content == ASSISTANT["content"] == res.content
    assert [c["id"] for c in calls] == ["functions.get_weather:0", "functions.search:1"]
    for got, want in zip(calls, ASSISTANT["tool_calls"]):
        assert got["name"] == want["function"]["name"]
        assert json.loads(got["arguments"]) == json.loads(want["function"]["arguments"])
    assert res.finish_reason == "tool_calls"
    for n in range(len(ids) + 1):  # truncation never raises
        run_parser(KimiLinearOutputParser(tok_k2), ids[:n], "length")


def test_kimi_linear_parser_think_split_across_tokens(tok_k2):
    p = KimiLinearOutputParser(tok_k2)
    out = []
    for piece in ["  <th", "ink>rea", "son</thi", "nk>answer <think> stays"]:
        out += p.feed_text(piece)
    out += p.finish()
    res = p.result()
    assert res.reasoning_content == "reason"
    assert res.content == "answer <think> stays"
    assert "".join(d.get("content", "") for d in out) == res.content


def test_k3_parser_unescaped_quote_in_key_falls_back(tok):
    asst = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "q", "function": {"name": "f", "arguments": json.dumps({'a"b': 1})}}]}
    ids = model_output(tok, asst, escape=False)
    deltas, res = run_parser(K3OutputParser(tok, unescape_attributes=False), ids)
    assert res.tool_calls == []
    assert 'argument key="a"b"' in res.content
    # with escaping on, the same call round-trips
    ids = model_output(tok, asst, escape=True)
    deltas, res = run_parser(K3OutputParser(tok), ids)
    assert json.loads(res.tool_calls[0]["function"]["arguments"]) == {'a"b': 1}


def test_parsers_give_calls_back_as_content_when_the_request_allows_no_tool_calls(tok, tok_k2):
    """OpenAI's contract: with no tools, or tool_choice "none", a response carries no tool_calls. A call the model
    writes anyway comes back as content text (the K3 call with its control tokens spelled out, the K2 call's id and
    arguments), finish reason "stop" — streamed per token or cut anywhere, never a tool-call delta."""
    k3_ids = model_output(tok, ASSISTANT)
    prompt = encode_chat_kimi_linear(tok_k2, USER, TOOLS)
    k2_ids = encode_chat_kimi_linear(tok_k2, USER + [ASSISTANT], TOOLS, add_generation_prompt=False)[len(prompt):]
    for make, ids in ((lambda: K3OutputParser(tok, thinking=True, tool_calls=False), k3_ids),
                      (lambda: KimiLinearOutputParser(tok_k2, tool_calls=False), k2_ids)):
        deltas, res = run_parser(make(), ids)
        assert res.tool_calls == [] and res.finish_reason == "stop"
        assert not any("tool_calls" in d for d in deltas)
        reasoning, content, _ = join_deltas(deltas)
        assert (reasoning, content) == (res.reasoning_content, res.content)
        assert reasoning == ASSISTANT["reasoning_content"] and content.startswith(ASSISTANT["content"])
        assert "get_weather" in content and "search" in content
        for n in range(len(ids) + 1):
            deltas, res = run_parser(make(), ids[:n], "length")
            assert res.tool_calls == [] and not any("tool_calls" in d for d in deltas)
    # the server's options: calls allowed only with tools and a tool_choice other than "none"
    from kimi_jax.serve.formats import ChatOptions, K3Format

    opts = ChatOptions(thinking=True, reasoning_effort=None)
    for tools, choice, allowed in (([], "auto", False), (TOOLS, "none", False), (TOOLS, "auto", True),
                                   (TOOLS, "required", True)):
        _, res = run_parser(K3Format(tok).new_parser(opts.with_tools(tools, choice)), k3_ids)
        assert bool(res.tool_calls) == allowed, (tools, choice)
