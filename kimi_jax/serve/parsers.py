"""Incremental parsers of generated assistant output into OpenAI-style deltas.

Feed generated token ids one at a time (``feed``), or text pieces and control tokens (``feed_text`` /
``feed_control``).  Each call returns a list of delta dicts in the shape of ``choices[i].delta`` of an OpenAI
``chat.completion.chunk``:

    {"reasoning_content": "..."}          reasoning text
    {"content": "..."}                    answer text
    {"tool_calls": [{"index": 0, "id": "call_...", "type": "function",
                     "function": {"name": "get_weather", "arguments": ""}}]}     first delta of a call
    {"tool_calls": [{"index": 0, "function": {"arguments": "{\\"city\\":\\""}}]}  argument text, in order

``finish(finish_reason)`` closes whatever is still open (truncated output), returns the last deltas, and
``result()`` returns the aggregate ``ParsedMessage``.  The concatenation of all deltas always equals the aggregate.
Nothing here raises on model output. K3: malformed or unparsable tool text ends up in ``content``, and arguments
are always a valid (strict) JSON object; K2: see below. ``tool_calls=False`` (the request gave no tools, or
tool_choice "none"): a call the model writes anyway is given back as ``content`` text the same way, never as a
tool call.

K3 (``K3OutputParser``), after the generation prompt ``...<|open|>think<|sep|>`` (or ``<|open|>response<|sep|>``):

* text inside ``think`` -> reasoning; inside ``response`` (or directly in the message) -> content;
* ``<|open|>call tool="NAME" index="i"<|sep|>`` inside ``tools`` starts a tool call; its ``argument key="K"
  type="T"`` elements become one JSON object: ``string`` values are JSON-quoted raw text (streamed as they arrive),
  other values are checked as JSON when the argument closes (invalid JSON -> the raw text as a JSON string);
  a ``<|open|>json type="object"<|sep|>{...}<|close|>json<|sep|>`` body is used as the arguments when it parses
  as a JSON object.  A call's first delta (its name) goes out when its first argument opens, or when it closes;
  a call whose header lacks ``tool=`` or whose json body does not parse is given back as ``content`` text (with
  the control tokens spelled out).  Truncated argument-form calls are closed so their arguments stay valid JSON;
  a tag header that the end of generation cut off (``<|close|>respon``) is dropped, not given back as text.
* ``<|end_of_msg|>`` / ``[EOS]`` end the message; later tokens are ignored.

Kimi-Linear / K2 (``KimiLinearOutputParser``): ``<think>...</think>`` (text, or control ids where the tokenizer has
them) -> reasoning; ``<|tool_calls_section_begin|>`` ... ``<|tool_call_begin|>functions.NAME:IDX
<|tool_call_argument_begin|>{json}<|tool_call_end|>`` ... ``<|tool_calls_section_end|>`` -> tool calls (arguments
streamed as the model writes them, so not checked: like OpenAI's own API, whose docs tell clients to validate
``arguments``, a call's arguments are invalid JSON when the model wrote them so; the call id is the
``functions.NAME:IDX`` text); ``<|im_end|>`` / ``[EOS]`` end.  Call ids as vLLM reads them: ``functions.NAME:IDX``
or ``NAME:IDX``; an id without ``:IDX`` (``functions.get.0``) is no call and goes back as content text; a bare counter
(``0``) names no function, so the name comes from the request's tools -- the only tool, or the one tool whose
``properties`` hold every argument key -- and the call is dropped when that is ambiguous or the arguments do not
parse (it is then emitted whole when it ends, not streamed).  Text after a tool section is kept as content
(vLLM drops it; OpenAI allows content beside calls).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from kimi_jax.serve.chat import unescape_attribute
from kimi_jax.tokenizer import StreamDecoder, Tokenizer

__all__ = [
    "K3OutputParser",
    "KimiLinearOutputParser",
    "ParsedMessage",
    "merge_deltas",
    "new_tool_call_id",
]


def new_tool_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ParsedMessage:
    """Aggregate of a parsed assistant turn."""

    reasoning_content: str = ""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    finish_reason: str = "stop"

    def to_openai(self) -> dict:
        """An OpenAI ``choices[i].message`` dict (``content`` null when empty and there are tool calls)."""
        content = self.content if (self.content or not self.tool_calls) else None
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning_content:
            msg["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            msg["tool_calls"] = [
                {"id": c["id"], "type": "function", "function": dict(c["function"])} for c in self.tool_calls
            ]
        return msg


def merge_deltas(deltas: Iterable[dict]) -> list[dict]:
    """Join adjacent deltas of the same kind (text of one field, or argument text of one tool call)."""
    out: list[dict] = []
    for d in deltas:
        if out:
            prev = out[-1]
            for key in ("reasoning_content", "content"):
                if set(d) == {key} and set(prev) == {key}:
                    prev[key] += d[key]
                    break
            else:
                if (
                    set(d) == {"tool_calls"}
                    and set(prev) == {"tool_calls"}
                    and len(d["tool_calls"]) == 1
                    and len(prev["tool_calls"]) == 1
                    and set(d["tool_calls"][0]) == {"index", "function"}
                    and d["tool_calls"][0]["index"] == prev["tool_calls"][0]["index"]
                    and set(d["tool_calls"][0]["function"]) == {"arguments"}
                ):
                    prev["tool_calls"][0]["function"]["arguments"] += d["tool_calls"][0]["function"]["arguments"]
                    continue
                out.append(_copy_delta(d))
                continue
            continue
        out.append(_copy_delta(d))
    return out


def _copy_delta(d: dict) -> dict:
    if "tool_calls" in d:
        return {
            "tool_calls": [
                {**tc, "function": dict(tc["function"])} if "function" in tc else dict(tc) for tc in d["tool_calls"]
            ]
        }
    return dict(d)


class _OutputParserBase:
    """Delta bookkeeping shared by the two formats."""

    def __init__(self, tokenizer: Tokenizer, id_factory: Callable[[], str] | None = None, tool_calls: bool = True):
        self.tok = tokenizer
        self._allow_calls = tool_calls
        self._decoder = StreamDecoder(tokenizer)
        self._id_factory = id_factory or new_tool_call_id
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._calls: list[dict] = []  # {"id", "name", "arguments": [str]}
        self._pending: list[dict] = []
        self._done = False
        self._finished = False
        self._truncated = False
        self._finish_reason = "stop"

    # ---------------------------------------------------------------- public
    @property
    def done(self) -> bool:
        """True once the end-of-message token was seen."""
        return self._done

    def feed(self, token_id: int) -> list[dict]:
        """Feed one generated id; returns the deltas it completes."""
        token_id = int(token_id)
        if self._finished or self._done:
            return []
        name = self.tok.special_name(token_id)
        if name is not None:
            self._on_text(self._decoder.flush())
            self._on_control(name)
        else:
            self._on_text(self._decoder.push_bytes(self.tok.token_bytes(token_id)))
        return self._take()

    def feed_many(self, ids: Iterable[int]) -> list[dict]:
        out: list[dict] = []
        for i in ids:
            out.extend(self.feed(i))
        return merge_deltas(out)

    def feed_text(self, text: str) -> list[dict]:
        """Feed decoded text (must not contain control tokens; those go through ``feed_control``)."""
        if self._finished or self._done:
            return []
        self._on_text(self._decoder.flush())
        self._on_text(text)
        return self._take()

    def feed_control(self, token: str | int) -> list[dict]:
        """Feed a control token by name or id."""
        if self._finished or self._done:
            return []
        name = token if isinstance(token, str) else self.tok.special_name(int(token))
        self._on_text(self._decoder.flush())
        if name is not None:
            self._on_control(name)
        return self._take()

    def finish(self, finish_reason: str = "stop") -> list[dict]:
        """End of generation: close what is open, return the last deltas.  ``finish_reason`` is the engine's
        ("stop" or "length"); the result reports "tool_calls" instead of "stop" when there are tool calls."""
        if self._finished:
            return []
        self._on_text(self._decoder.flush())
        self._truncated = True  # what is still open was cut by the end of generation, not closed by the model
        self._close_all()
        self._finished = True
        self._finish_reason = finish_reason
        return self._take()

    def result(self) -> ParsedMessage:
        """The aggregate; call after ``finish`` (it is called with "stop" if not)."""
        if not self._finished:
            self.finish()
        reason = self._finish_reason
        if self._calls and reason == "stop":
            reason = "tool_calls"
        return ParsedMessage(
            reasoning_content="".join(self._reasoning),
            content="".join(self._content),
            tool_calls=[
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {"name": c["name"], "arguments": "".join(c["arguments"])},
                }
                for c in self._calls
            ],
            finish_reason=reason,
        )

    # ---------------------------------------------------------------- emitters
    def _take(self) -> list[dict]:
        out = merge_deltas(self._pending)
        self._pending = []
        return out

    def _emit_reasoning(self, s: str) -> None:
        if s:
            self._reasoning.append(s)
            self._pending.append({"reasoning_content": s})

    def _emit_content(self, s: str) -> None:
        if s:
            self._content.append(s)
            self._pending.append({"content": s})

    def _start_call(self, name: str, call_id: str | None = None) -> int:
        index = len(self._calls)
        cid = call_id or self._id_factory()
        self._calls.append({"id": cid, "name": name, "arguments": []})
        self._pending.append(
            {
                "tool_calls": [
                    {"index": index, "id": cid, "type": "function", "function": {"name": name, "arguments": ""}}
                ]
            }
        )
        return index

    def _emit_args(self, index: int, s: str) -> None:
        if s:
            self._calls[index]["arguments"].append(s)
            self._pending.append({"tool_calls": [{"index": index, "function": {"arguments": s}}]})

    # ---------------------------------------------------------------- format hooks
    def _on_text(self, s: str) -> None:
        raise NotImplementedError

    def _on_control(self, name: str) -> None:
        raise NotImplementedError

    def _close_all(self) -> None:
        raise NotImplementedError


# ====================================================================================================================
# K3

_TAG_RE = re.compile(r'^\s*([A-Za-z_][\w.\-]*)((?:\s+[A-Za-z_][\w.\-]*="[^"]*")*)\s*$', re.S)
_ATTR_RE = re.compile(r'([A-Za-z_][\w.\-]*)="([^"]*)"')
_END_NAMES = ("<|end_of_msg|>", "[EOS]", "[EOT]")


class _Elem:
    __slots__ = ("header", "tag", "attrs", "raw", "name", "index", "nargs", "failed", "key", "vtype", "buf", "json_ok")

    def __init__(self, tag: str, attrs: dict[str, str], raw: str):
        self.header = raw
        self.tag = tag
        self.attrs = attrs
        self.raw: list[str] | None = [raw] if tag == "call" else None  # text to give back if the call fails
        self.name = ""
        self.index: int | None = None  # OpenAI index once the call's first delta went out
        self.nargs = 0
        self.failed = False
        self.key = ""
        self.vtype = "string"
        self.buf: list[str] = []
        self.json_ok = False


class K3OutputParser(_OutputParserBase):
    """Parser of K3-format assistant output.

    ``thinking`` must match the generation prompt (True: it ended with ``<|open|>think<|sep|>``; False:
    ``<|open|>response<|sep|>``); ``start="message"`` means the prompt ended with the assistant message header only,
    ``start="root"`` that nothing of the message was in the prompt.  ``unescape_attributes`` mirrors
    ``encode_chat(escape_attributes=...)``.  ``id_factory`` makes tool-call ids (default ``call_<24 hex>``).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        thinking: bool = True,
        *,
        start: str | None = None,
        unescape_attributes: bool = True,
        id_factory: Callable[[], str] | None = None,
        tool_calls: bool = True,
    ):
        super().__init__(tokenizer, id_factory, tool_calls)
        self._unescape = unescape_attributes
        self._stack: list[_Elem] = []
        start = start or ("think" if thinking else "response")
        if start not in ("root", "message", "think", "response"):
            raise ValueError(f"start must be root, message, think or response, got {start!r}")
        if start != "root":
            self._stack.append(_Elem("message", {"role": "assistant"}, ""))
        if start in ("think", "response"):
            self._stack.append(_Elem(start, {}, ""))
        self._mode = "body"  # body | open | close (collecting a tag header after <|open|> / <|close|>)
        self._cut = False  # closing what the end of generation left open: no closing tag was written
        self._hdr: list[str] = []

    # ---------------------------------------------------------------- helpers
    def _top(self) -> _Elem | None:
        return self._stack[-1] if self._stack else None

    def _open_call(self) -> _Elem | None:
        for e in reversed(self._stack):
            if e.tag == "call":
                return e
        return None

    def _capture(self, s: str) -> None:
        """Record raw text for the innermost not-yet-announced call (fallback to content)."""
        call = self._open_call()
        if call is not None and call.index is None and call.raw is not None:
            call.raw.append(s)

    def _stray(self, s: str) -> None:
        """Text that is not part of a recognised structure: reasoning inside think, else content."""
        if not s:
            return
        for e in reversed(self._stack):
            if e.tag == "think":
                self._emit_reasoning(s)
                return
            if e.tag in ("response", "message"):
                break
        self._emit_content(s)

    def _attr(self, elem_attrs: dict[str, str], key: str) -> str | None:
        v = elem_attrs.get(key)
        if v is None:
            return None
        return unescape_attribute(v) if self._unescape else v

    def _announce(self, call: _Elem) -> None:
        if call.index is None:
            call.index = self._start_call(call.name)
            call.raw = None

    # ---------------------------------------------------------------- text
    def _on_text(self, s: str) -> None:
        if not s:
            return
        if self._mode != "body":
            self._hdr.append(s)
            return
        top = self._top()
        tag = top.tag if top is not None else None
        if tag == "think":
            self._emit_reasoning(s)
        elif tag in ("response", "message", None):
            self._emit_content(s)
        elif tag == "argument":
            call = self._open_call()
            if top.vtype == "string" and call is not None and call.index is not None:
                self._emit_args(call.index, json.dumps(s, ensure_ascii=False)[1:-1])
            else:
                top.buf.append(s)
            self._capture(s)
        elif tag == "json":
            top.buf.append(s)
            self._capture(s)
        elif tag == "call":
            self._capture(s)  # text between arguments: kept only for the fallback
        elif tag == "tools":
            top.buf.append(s)  # text between calls: decided at the next control token (_flush_tools_text)
        else:
            self._emit_content(s)

    # ---------------------------------------------------------------- control tokens
    def _flush_tools_text(self) -> None:
        """Text written directly inside ``tools`` (between calls) is content unless it is all whitespace.  It is held
        until the next control token, so the answer does not depend on how the text was cut into pieces."""
        top = self._top()
        if top is not None and top.tag == "tools" and top.buf:
            text, top.buf = "".join(top.buf), []
            if text.strip():
                self._emit_content(text)

    def _on_control(self, name: str) -> None:
        self._flush_tools_text()
        if name in ("<|open|>", "<|close|>"):
            if self._mode != "body":
                self._abandon_header()
            self._mode = "open" if name == "<|open|>" else "close"
            self._hdr = []
            return
        if name == "<|sep|>":
            if self._mode == "body":
                return  # a stray separator carries nothing
            header = "".join(self._hdr)
            mode, self._mode, self._hdr = self._mode, "body", []
            if mode == "open":
                self._open(header)
            else:
                self._close(header)
            return
        if name in _END_NAMES:
            if self._mode != "body":
                self._abandon_header()
            self._close_all()
            self._done = True
            return
        # media / reserved / [BOS] / [PAD]: nothing to say

    def _abandon_header(self) -> None:
        raw = ("<|open|>" if self._mode == "open" else "<|close|>") + "".join(self._hdr)
        self._mode, self._hdr = "body", []
        self._raw_text(raw)

    def _raw_text(self, raw: str) -> None:
        """Text spelled out from control tokens: inside a leaf or an unannounced call it stays in the value or the
        call's fallback text; elsewhere it is stray text."""
        top = self._top()
        if top is not None and top.tag in ("argument", "json"):
            self._on_text(raw)
        elif top is not None and top.tag == "call" and top.index is None:
            top.failed = True  # unknown structure inside a call: the whole call goes back as text
            self._capture(raw)
        else:
            self._stray(raw)

    def _open(self, header: str) -> None:
        raw = f"<|open|>{header}<|sep|>"
        m = _TAG_RE.match(header)
        top = self._top()
        if m is None or (top is not None and top.tag in ("argument", "json")):
            self._raw_text(raw)
            return
        tag = m.group(1)
        attrs = dict(_ATTR_RE.findall(m.group(2)))
        if tag in ("message", "think", "response", "tools"):
            if self._open_call() is not None:
                self._raw_text(raw)  # structure tags inside a call: not ours
                return
            self._stack.append(_Elem(tag, attrs, raw))
        elif tag == "call":
            if self._open_call() is not None:
                self._close_to(self._open_call())  # a new call closes an unterminated one
            elem = _Elem("call", attrs, raw)
            name = self._attr(attrs, "tool")
            if not name or not self._allow_calls:  # no tool calls allowed: the call goes back as content text
                elem.failed = True
            else:
                elem.name = name
            self._stack.append(elem)
        elif tag in ("argument", "json"):
            call = self._open_call()
            if call is None or top is not call:
                self._raw_text(raw)
                return
            if call.raw is not None:
                call.raw.append(raw)
            elem = _Elem(tag, attrs, raw)
            if tag == "argument":
                key = self._attr(attrs, "key")
                if key is None or call.failed:
                    call.failed = True
                    self._stack.append(elem)
                    elem.vtype = "skip"
                    return
                elem.key = key
                elem.vtype = (self._attr(attrs, "type") or "string").strip().lower()
                self._announce(call)
                prefix = ("{" if call.nargs == 0 else ",") + json.dumps(key, ensure_ascii=False) + ":"
                call.nargs += 1
                if elem.vtype == "string":
                    prefix += '"'
                self._emit_args(call.index, prefix)
            self._stack.append(elem)
        else:
            self._raw_text(raw)

    def _close(self, header: str) -> None:
        raw = f"<|close|>{header}<|sep|>"
        tag = header.strip()
        target = None
        for e in reversed(self._stack):
            if e.tag == tag:
                target = e
                break
        if target is None:
            self._raw_text(raw)
            return
        self._close_to(target)  # a call that falls back adds its own closing text in _finalize

    def _close_to(self, target: _Elem) -> None:
        while self._stack:
            e = self._stack.pop()
            self._finalize(e)
            if e is target:
                return

    def _close_all(self) -> None:
        self._flush_tools_text()
        if self._mode != "body":
            if self._truncated:  # a tag header cut off by the end of generation is markup, not text: dropped
                self._mode, self._hdr = "body", []
            else:
                self._abandon_header()
        self._cut = True
        while self._stack:
            self._finalize(self._stack.pop())

    def _closing(self, tag: str) -> str:
        """The closing tag as the model wrote it — nothing when the element was cut off by the end of generation
        (text given back as content must not gain tags the model never produced)."""
        return "" if self._cut else f"<|close|>{tag}<|sep|>"

    def _finalize(self, e: _Elem) -> None:
        call = self._open_call()  # the enclosing call (e has been popped already)
        if e.tag == "argument":
            if call is None:
                return
            if call.raw is not None:
                call.raw.append(self._closing("argument"))
            if call.index is None:
                return
            if e.vtype == "skip":  # an argument without key in an announced call: give its text back
                self._stray(e.header + "".join(e.buf) + self._closing("argument"))
                return
            if e.vtype == "string":
                self._emit_args(call.index, '"')
            else:
                text = "".join(e.buf).strip()
                try:
                    _strict_json(text)
                    value = text
                except ValueError:
                    value = json.dumps("".join(e.buf), ensure_ascii=False)
                self._emit_args(call.index, value)
        elif e.tag == "json":
            if call is None:
                return
            text = "".join(e.buf).strip()
            if call.raw is not None:
                call.raw.append(self._closing("json"))
            ok = False
            try:
                ok = isinstance(_strict_json(text), dict)
            except ValueError:
                ok = False
            if not ok or call.failed or call.nargs > 0 or call.json_ok:
                call.failed = True
                return
            call.json_ok = True
            e.buf = [text]
            call.buf = [text]
        elif e.tag == "call":
            if e.failed and e.index is None:
                self._stray("".join(e.raw or []) + self._closing("call"))
                return
            if e.index is None:
                self._announce(e)
                self._emit_args(e.index, e.buf[0] if e.json_ok else "{}")
            elif e.nargs > 0:
                self._emit_args(e.index, "}")
            elif e.json_ok:
                self._emit_args(e.index, e.buf[0])
            else:
                self._emit_args(e.index, "{}")


# ====================================================================================================================
# Kimi-Linear / K2

_K2_ID_RE = re.compile(r"^\s*(?:functions\.)?([^\s:]+):(\d+)\s*$")
_K2_COUNTER_RE = re.compile(r"^\s*\d+\s*$")
_K2_END_NAMES = ("<|im_end|>", "[EOS]", "[EOT]")


class KimiLinearOutputParser(_OutputParserBase):
    """Parser of Kimi-Linear / K2-format assistant output (``<think>`` reasoning, tool-call section).

    ``in_reasoning=True`` when the prompt already ended with ``<think>``.
    """

    _OPEN_TAG = "<think>"
    _CLOSE_TAG = "</think>"

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        in_reasoning: bool = False,
        id_factory: Callable[[], str] | None = None,
        tool_calls: bool = True,
        tools: Iterable[dict] = (),
    ):
        super().__init__(tokenizer, id_factory, tool_calls)
        self._tools = [t.get("function", t) for t in tools if isinstance(t, dict)]
        self._counter: dict | None = None  # a bare-counter call being collected: {"id", "args": [str]}
        self._state = "reasoning" if in_reasoning else "content"  # content | reasoning | section | call_id | args
        self._seen_content = False
        self._held = ""  # text held back while it may be the start of a <think> tag
        self._id_buf: list[str] = []
        self._call_index: int | None = None
        self._args_len = 0
        self._section_raw: list[str] = []

    # ---------------------------------------------------------------- text
    def _on_text(self, s: str) -> None:
        if not s:
            return
        st = self._state
        if st in ("content", "reasoning"):
            self._scan(s)
        elif st == "call_id":
            self._id_buf.append(s)
        elif st == "args":
            if self._counter is not None:
                self._counter["args"].append(s)
            elif self._call_index is not None:
                self._emit_args(self._call_index, s)
                self._args_len += len(s)
            else:
                self._emit_content(s)  # arguments of a call whose id did not parse
        elif st == "section":
            pass  # text between calls carries nothing

    def _scan(self, s: str) -> None:
        text = self._held + s
        self._held = ""
        while text:
            if self._state == "reasoning":
                pos = text.find(self._CLOSE_TAG)
                if pos >= 0:
                    self._emit_reasoning(text[:pos])
                    text = text[pos + len(self._CLOSE_TAG) :]
                    self._state = "content"
                    self._seen_content = True  # no second <think> block
                    continue
                keep = _partial_suffix(text, self._CLOSE_TAG)
                self._emit_reasoning(text[: len(text) - keep])
                self._held = text[len(text) - keep :]
                return
            # content: <think> only counts before any content (leading whitespace aside)
            if not self._seen_content:
                stripped = text.lstrip()
                if stripped.startswith(self._OPEN_TAG):
                    text = stripped[len(self._OPEN_TAG) :]
                    self._state = "reasoning"
                    continue
                if stripped and self._OPEN_TAG.startswith(stripped):
                    self._held = text  # may still become <think>
                    return
                if stripped:
                    self._seen_content = True
                else:
                    self._held = text  # whitespace only so far
                    return
            self._emit_content(text)
            return

    def _flush_held(self) -> None:
        if self._held:
            held, self._held = self._held, ""
            if self._state == "reasoning":
                self._emit_reasoning(held)
            else:
                self._seen_content = self._seen_content or bool(held.strip())
                self._emit_content(held)

    # ---------------------------------------------------------------- control tokens
    def _on_control(self, name: str) -> None:
        st = self._state
        if name == "<think>" and st == "content":
            self._flush_held()
            self._state = "reasoning"
            return
        if name == "</think>" and st == "reasoning":
            self._flush_held()
            self._state = "content"
            self._seen_content = True
            return
        if name == "<|tool_calls_section_begin|>" and st in ("content", "reasoning"):
            self._flush_held()
            self._state = "section"
            return
        if name == "<|tool_call_begin|>" and st in ("section", "content", "reasoning"):
            self._flush_held()
            self._end_call()
            self._state = "call_id"
            self._id_buf = []
            return
        if name == "<|tool_call_argument_begin|>" and st == "call_id":
            ref = "".join(self._id_buf)
            if self._allow_calls and _K2_COUNTER_RE.match(ref):
                self._counter = {"id": ref.strip(), "args": []}
                self._call_index = None
                self._state = "args"
                return
            m = _K2_ID_RE.match(ref) if self._allow_calls else None
            if m is None:  # an id that does not parse (or no calls allowed): the call goes back as content text
                self._emit_content("<|tool_call_begin|>" + ref + "<|tool_call_argument_begin|>")
                self._state = "args"
                self._call_index = None
                return
            self._call_index = self._start_call(m.group(1), ref.strip())
            self._args_len = 0
            self._state = "args"
            return
        if name == "<|tool_call_end|>" and st in ("args", "call_id"):
            if st == "call_id":
                self._emit_content("<|tool_call_begin|>" + "".join(self._id_buf) + "<|tool_call_end|>")
            self._end_call()
            self._state = "section"
            return
        if name == "<|tool_calls_section_end|>":
            self._end_call()
            self._state = "content"
            return
        if name in _K2_END_NAMES:
            self._close_all()
            self._done = True
            return
        # anything else: ignore

    def _end_call(self) -> None:
        if self._counter is not None:
            counter, self._counter = self._counter, None
            args = "".join(counter["args"]).strip()
            name = self._counter_name(args)
            if name is not None:
                self._emit_args(self._start_call(name, counter["id"]), args or "{}")
        if self._call_index is not None and self._args_len == 0:
            self._emit_args(self._call_index, "{}")
        self._call_index = None
        self._args_len = 0

    def _counter_name(self, args: str) -> str | None:
        """The function a bare-counter call means: the only tool, else the one tool whose properties hold every
        argument key; None when none or several fit, or the arguments are no JSON object."""
        names = [f.get("name") for f in self._tools if isinstance(f.get("name"), str)]
        if len(names) == 1:
            return names[0]
        try:
            obj = _strict_json(args) if args else {}
        except ValueError:
            return None
        if not isinstance(obj, dict):
            return None
        fits = []
        for f in self._tools:
            params = f.get("parameters") if isinstance(f.get("parameters"), dict) else {}
            props = params.get("properties") if isinstance(params.get("properties"), dict) else {}
            if isinstance(f.get("name"), str) and set(obj) <= set(props):
                fits.append(f["name"])
        return fits[0] if len(fits) == 1 else None

    def _close_all(self) -> None:
        self._flush_held()
        if self._state == "call_id" and self._id_buf and not self._truncated:  # a cut-off call id: dropped
            self._emit_content("<|tool_call_begin|>" + "".join(self._id_buf))
        self._end_call()
        self._state = "content"


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _strict_json(text: str):
    """`json.loads` without Python's extensions NaN / Infinity / -Infinity, which OpenAI clients (and JSON.parse)
    reject: a value written as NaN is not valid JSON in a tool call's arguments."""
    return json.loads(text, parse_constant=_reject_constant)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
