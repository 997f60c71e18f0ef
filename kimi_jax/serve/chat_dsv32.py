"""DeepSeek-V3.2's chat format: prompt encoding and the output parser for its DSML tool calls.

Prompt (as the model's release encodes it)::

    <｜begin▁of▁sentence｜>{system}[\\n\\n## Tools ...<functions>{schema per line}</functions>\\n]
    <｜User｜>{user}<｜Assistant｜></think>            (<think> instead after the last user turn, thinking on)
    [reasoning</think>]{answer}[\\n\\n<｜DSML｜function_calls>\\n<｜DSML｜invoke name="NAME">\\n
        <｜DSML｜parameter name="K" string="true|false">VALUE</｜DSML｜parameter>\\n...</｜DSML｜invoke>\\n
        </｜DSML｜function_calls>]<｜end▁of▁sentence｜>
    \\n\\n<function_results>\\n<result>{tool output}</result>...\\n</function_results>\\n\\n</think>   (or <think>)

* A parameter's VALUE is the string itself (``string="true"``) or its compact JSON (``string="false"``: numbers,
  booleans, arrays, objects, null).  ``｜DSML｜`` is text, not a control token; ``<｜User｜>``, ``<｜Assistant｜>``,
  the sentence markers and ``<think>`` / ``</think>`` are control ids where the tokenizer has them, text otherwise.
* The request's tools go into the first system message (one is added, empty, when there is none), after
  ``\\n\\n``; a ``developer`` message is written as the release does: a user turn that starts with the tools and
  ends ``# The user's message is: {content}``.
* With thinking on, assistant turns before the last user message lose their reasoning; later ones keep it as
  ``{reasoning}</think>``.
* Tool results follow the assistant turn that called them, in order, wrapped in one ``<function_results>`` block
  per turn; the block ends with the thinking token the next assistant turn starts with.

Output parser (``DSV32OutputParser``): reasoning until ``</think>`` (thinking on), then content; a
``<｜DSML｜function_calls>`` block (the blank line before it dropped) becomes ``tool_calls``: each ``invoke`` a call
(its name announced once the ``invoke`` tag is complete), each parameter appended to the call's JSON arguments
when its closing tag arrives (a ``string="false"`` value that is no JSON is passed as a string).  A block cut off by
the end of generation is closed, so the arguments stay valid JSON.  Text after the block stays content.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable

from kimi_jax.tokenizer import Tokenizer

from .chat import Segment, _content_text, _reasoning_text, _Segments, segments_to_ids
from .parsers import _OutputParserBase, _partial_suffix, new_tool_call_id

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
THINK, END_THINK = "<think>", "</think>"
DSML = "｜DSML｜"
CONTROL_NAMES = (BOS, EOS, USER, ASSISTANT)

TOOLS_TEMPLATE = """## Tools
You have access to a set of tools you can use to answer the user's question.
You can invoke functions by writing a "<{d}function_calls>" block like the following as part of your reply to the user:
<{d}function_calls>
<{d}invoke name="$FUNCTION_NAME">
<{d}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{d}parameter>
...
</{d}invoke>
<{d}invoke name="$FUNCTION_NAME2">
...
</{d}invoke>
</{d}function_calls>
String and scalar parameters should be specified as is without any escaping or quotes, while lists and objects \
should use JSON format. The "string" attribute should be set to "true" for string type parameters and "false" for \
other types (numbers, booleans, arrays, objects).
If the thinking_mode is enabled, then after function results you should strongly consider outputting a thinking \
block. Here is an example:
<{d}function_calls>
...
</{d}function_calls>
<function_results>
...
</function_results>
{think}...thinking about results{end_think}
Here are the functions available in JSONSchema format:
<functions>
{schemas}
</functions>
"""


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def render_tools(tools: list[dict]) -> str:
    fns = [t.get("function", t) for t in tools]
    return TOOLS_TEMPLATE.format(d=DSML, think=THINK, end_think=END_THINK, schemas="\n".join(_json(f) for f in fns))


def render_call(name: str, arguments: Any) -> str:
    """One ``invoke`` element; ``arguments`` a JSON object or its text."""
    args = json.loads(arguments) if isinstance(arguments, str) else (arguments or {})
    if not isinstance(args, dict):
        raise ValueError(f"tool call {name!r}: arguments must be a JSON object")
    params = [f'<{DSML}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
              f'{v if isinstance(v, str) else _json(v)}</{DSML}parameter>' for k, v in args.items()]
    return f'<{DSML}invoke name="{name}">\n' + "\n".join(params) + f"\n</{DSML}invoke>"


class _Writer(_Segments):
    def __init__(self, tokenizer: Tokenizer):
        super().__init__(tokenizer, ())  # DeepSeek's markers are optional: `mark` spells missing ones as text

    def mark(self, name: str) -> None:
        """A control token where the tokenizer has it, its spelling as text otherwise."""
        if self.tok.has_token(name):
            self.out.append(self.tok.token_id(name))
        else:
            self.text(name)


def render_chat_segments_dsv32(tokenizer: Tokenizer, messages: list[dict], tools: list[dict] | None = None, *,
                               thinking: bool = False) -> list[Segment]:
    msgs = [dict(m) for m in messages]
    if tools:
        sys_idx = next((i for i, m in enumerate(msgs) if m.get("role") == "system"), None)
        if sys_idx is None:
            msgs.insert(0, {"role": "system", "content": ""})
            sys_idx = 0
        msgs[sys_idx]["_tools"] = tools
    last_user = max((i for i, m in enumerate(msgs) if m.get("role") in ("user", "developer")), default=-1)
    w = _Writer(tokenizer)
    w.mark(BOS)
    for i, m in enumerate(msgs):
        role = m.get("role")
        where = f"messages[{i}]"
        after_turn = THINK if (thinking and i == last_user) else END_THINK
        if role == "system":
            w.text(_content_text(m.get("content"), where))
            if m.get("_tools"):
                w.text("\n\n" + render_tools(m["_tools"]))
        elif role == "developer":
            text = _content_text(m.get("content"), where)
            if not text:
                raise ValueError(f"{where}: a developer message needs content")
            w.mark(USER)
            w.text(f"\n\n# The user's message is: {text}")
            w.mark(ASSISTANT)
            w.mark(after_turn)
        elif role == "user":
            w.mark(USER)
            w.text(_content_text(m.get("content"), where))
            w.mark(ASSISTANT)
            w.mark(after_turn)
        elif role == "assistant":
            if thinking and i > last_user:
                w.text(_reasoning_text(m))
                w.mark(END_THINK)
            w.text(_content_text(m.get("content"), where))
            calls = m.get("tool_calls") or []
            if calls:
                rendered = []
                for c in calls:
                    fn = c.get("function") if isinstance(c, dict) else None
                    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                        raise ValueError(f"{where}: each tool call needs function.name")
                    rendered.append(render_call(fn["name"], fn.get("arguments") or "{}"))
                w.text(f"\n\n<{DSML}function_calls>\n" + "\n".join(rendered) + f"\n</{DSML}function_calls>")
            w.mark(EOS)
        elif role == "tool":
            j = i - 1
            while j >= 0 and msgs[j].get("role") == "tool":
                j -= 1
            calls = msgs[j].get("tool_calls") if j >= 0 and msgs[j].get("role") == "assistant" else None
            order = i - j
            if not calls or len(calls) < order:
                raise ValueError(f"{where}: a tool result without a matching assistant tool call")
            if order == 1:
                w.text("\n\n<function_results>")
            w.text(f"\n<result>{_content_text(m.get('content'), where)}</result>")
            if order == len(calls):
                w.text("\n</function_results>\n\n")
                w.mark(THINK if (thinking and i >= last_user) else END_THINK)
        else:
            raise ValueError(f"{where}: unknown role {role!r}")
    return w.out


def encode_chat_dsv32(tokenizer: Tokenizer, messages: list[dict], tools: list[dict] | None = None, *,
                      thinking: bool = False) -> list[int]:
    return segments_to_ids(tokenizer, render_chat_segments_dsv32(tokenizer, messages, tools, thinking=thinking))


# ----------------------------------------------------------------------------------------------------------- parser
_CALLS_OPEN = f"<{DSML}function_calls>"
_CALLS_CLOSE = f"</{DSML}function_calls>"
_INVOKE_RE = re.compile(r'\s*<' + DSML + r'invoke\s+name="([^"]*)"\s*>', re.S)
_PARAM_RE = re.compile(r'\s*<' + DSML + r'parameter\s+name="([^"]*)"\s+string="(true|false)"\s*>(.*?)</' + DSML
                       + r'parameter>', re.S)
_INVOKE_CLOSE_RE = re.compile(r"\s*</" + DSML + r"invoke>", re.S)
_CALLS_CLOSE_RE = re.compile(r"\s*" + re.escape(_CALLS_CLOSE), re.S)


class DSV32OutputParser(_OutputParserBase):
    def __init__(self, tokenizer: Tokenizer, *, thinking: bool = False, id_factory: Callable[[], str] | None = None,
                 tool_calls: bool = True):
        super().__init__(tokenizer, id_factory or new_tool_call_id, tool_calls)
        self._state = "reasoning" if thinking else "content"  # reasoning | content | calls
        self._buf = ""  # text held: a possible marker prefix (content / reasoning) or unparsed DSML (calls)
        self._call: int | None = None  # index of the open call
        self._nparams = 0

    # ---------------------------------------------------------------- text
    def _on_text(self, s: str) -> None:
        if s:
            self._buf += s
            self._advance()

    def _advance(self, final: bool = False) -> None:
        while self._buf:
            if self._state == "reasoning":
                pos = self._buf.find(END_THINK)
                if pos >= 0:
                    self._emit_reasoning(self._buf[:pos])
                    self._buf = self._buf[pos + len(END_THINK):]
                    self._state = "content"
                    continue
                keep = 0 if final else _partial_suffix(self._buf, END_THINK)
                self._emit_reasoning(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                return
            if self._state == "content":
                pos = self._buf.find(_CALLS_OPEN) if self._allow_calls else -1
                if pos >= 0:
                    before = self._buf[:pos]
                    self._emit_content(before[:-2] if before.endswith("\n\n") else before)
                    self._buf = self._buf[pos + len(_CALLS_OPEN):]
                    self._state = "calls"
                    continue
                if final or not self._allow_calls:
                    self._emit_content(self._buf)
                    self._buf = ""
                    return
                keep = _partial_suffix(self._buf, _CALLS_OPEN)
                # the blank line before the block is not content: hold trailing newlines back too
                head = self._buf[: len(self._buf) - keep]
                stripped = head.rstrip("\n")
                self._emit_content(stripped)
                self._buf = head[len(stripped):] + self._buf[len(self._buf) - keep:]
                return
            # calls: consume complete elements
            if self._call is None:
                m = _INVOKE_RE.match(self._buf)
                if m:
                    self._call = self._start_call(m.group(1))
                    self._nparams = 0
                    self._buf = self._buf[m.end():]
                    continue
                m = _CALLS_CLOSE_RE.match(self._buf)
                if m:
                    self._buf = self._buf[m.end():]
                    self._state = "content"
                    continue
            else:
                m = _PARAM_RE.match(self._buf)
                if m:
                    self._param(m.group(1), m.group(2) == "true", m.group(3))
                    self._buf = self._buf[m.end():]
                    continue
                m = _INVOKE_CLOSE_RE.match(self._buf)
                if m:
                    self._end_call()
                    self._buf = self._buf[m.end():]
                    continue
            if final or not self._buf.strip():
                if final:
                    self._buf = ""
                return
            return  # an element not complete yet: wait for more text

    def _param(self, key: str, is_str: bool, value: str) -> None:
        if is_str:
            v = _json(value)
        else:
            try:
                json.loads(value)
                v = value.strip()
            except ValueError:
                v = _json(value)
        self._emit_args(self._call, ("{" if self._nparams == 0 else ", ") + f"{_json(key)}: {v}")
        self._nparams += 1

    def _end_call(self) -> None:
        if self._call is not None:
            self._emit_args(self._call, "{}" if self._nparams == 0 else "}")
        self._call = None

    # ---------------------------------------------------------------- control tokens
    def _on_control(self, name: str) -> None:
        if name == END_THINK and self._state == "reasoning":
            self._advance(final=True)
            self._state = "content"
        elif name == THINK and self._state == "content" and not self._content:
            self._state = "reasoning"
        elif name in (EOS, "[EOS]"):
            self._close_all()
            self._done = True

    def _close_all(self) -> None:
        self._advance(final=True)
        self._end_call()
        if self._state == "calls":
            self._state = "content"

