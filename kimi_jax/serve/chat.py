"""Chat prompts as token-id segments (docs/model.md §11).  There is no Jinja template: a prompt is a list of segments,
each either text (tokenised with ``Tokenizer.encode``, which never yields control ids) or a control-token id.

K3 family (Kimi K3 / K3.1 Pro)::

    <|open|>message role="system" type="tool-declare"<|sep|># Tools\\n[...]<|close|>message<|sep|><|end_of_msg|>
    <|open|>message role="system" type="thinking-effort"<|sep|>max<|close|>message<|sep|><|end_of_msg|>
    <|open|>message role="system"<|sep|>{text}<|close|>message<|sep|><|end_of_msg|>
    <|open|>message role="user"<|sep|>{text}<|close|>message<|sep|><|end_of_msg|>
    <|open|>message role="assistant"<|sep|><|open|>think<|sep|>{reasoning}<|close|>think<|sep|>
        <|open|>response<|sep|>{answer}<|close|>response<|sep|>[tools]<|close|>message<|sep|><|end_of_msg|>
    <|open|>message role="tool" name="{fn}"<|sep|>{result}<|close|>message<|sep|><|end_of_msg|>
    generation prompt: <|open|>message role="assistant"<|sep|><|open|>think<|sep|>
                       (thinking off: <|open|>message role="assistant"<|sep|><|open|>response<|sep|>)

    tools: <|open|>tools<|sep|><|open|>call tool="NAME" index="1"<|sep|>
             <|open|>argument key="K" type="string"<|sep|>VALUE<|close|>argument<|sep|> ... <|close|>call<|sep|> ...
           <|close|>tools<|sep|>

Choices made here for the points docs/model.md §11 leaves open -- each is an argument:

* ``escape_attributes=True``: attribute values (tool names, argument keys) escape ``&`` ``"`` ``<`` ``>`` as
  ``&amp;`` ``&quot;`` ``&lt;`` ``&gt;``; ``False`` writes them raw.  Message text is never escaped.
* ``keep_past_reasoning=False``: ``reasoning_content`` of assistant turns *before the last user message* is dropped;
  turns after it (the current agentic tool loop) keep theirs.  ``True`` keeps all reasoning.
* Where an assistant turn's reasoning is dropped or empty: an empty ``<|open|>think<|sep|><|close|>think<|sep|>``
  block is written when ``thinking`` is on (every assistant turn then has the shape the model generates), and no
  think block at all when thinking is off (matching the thinking-off generation prompt).
* The response block is always written (empty when the turn only calls tools).
* Tool calls are numbered ``index="1"``, ``"2"``, ... within a turn (``CALL_INDEX_BASE``).  Arguments that are a JSON
  object are written as ``argument`` elements (strings raw, everything else compact JSON, ``type`` from the JSON
  value); any other arguments text is written as one ``<|open|>json type="object"<|sep|>{...}<|close|>json<|sep|>``.
* The tool-declare message holds ``"# Tools\\n"`` + the request's ``tools`` list as compact JSON (``,`` ``:``
  separators, non-ASCII kept), in the order given.
* The thinking-effort message is written only when thinking is on; ``reasoning_effort`` accepts ``low`` / ``high`` /
  ``max`` and maps the OpenAI names ``minimal``->low, ``medium``->high, ``xhigh``->max; ``"none"`` turns thinking off.
* Order: tool-declare, thinking-effort, then the conversation (its own system messages included, in place).
* Message ``content`` may be a string, ``None`` or a list of ``{"type": "text", "text": ...}`` parts (joined without
  separator).  A *user* message may also hold ``{"type": "image_url", ...}`` parts: each is written, in part order,
  as ``<|media_begin|>image {W}x{H}<|media_content|>`` + ``<|media_pad|>`` × n + ``<|media_end|>`` (docs/model.md
  §9; all control ids), from the ``ChatImage`` (original pixel width W, height H, n = the vision tower's token count) the
  caller passes for it in ``images`` -- the caller has fetched and decoded them, in the order of their parts.
  Image parts in other roles, and any other part type (audio, video), are rejected with ``ValueError``.  Role ``developer`` is written as
  ``system``.  A tool message's ``name`` comes from the message or, failing that, from the assistant tool call with
  the same ``tool_call_id``; when neither exists the ``name`` attribute is left out.

Kimi-Linear / Kimi K2 family (``encode_chat_kimi_linear``)::

    <|im_system|>tool_declare<|im_middle|>[...]<|im_end|>
    <|im_system|>system<|im_middle|>{text}<|im_end|>
    <|im_user|>user<|im_middle|>{text}<|im_end|>
    <|im_assistant|>assistant<|im_middle|><think>{reasoning}</think>{answer}<|tool_calls_section_begin|>
        <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|>...
        <|tool_calls_section_end|><|im_end|>
    <|im_system|>tool<|im_middle|>## Return of functions.NAME:IDX\\n{result}<|im_end|>
    generation prompt: <|im_assistant|>assistant<|im_middle|>   (+ "<think>" when thinking=True)

``<think>``/``</think>`` are written as control ids when the tokenizer has them (K2-Thinking), else as text.
This format has no documented media form: image parts are rejected with ``ValueError``.
Tool-call ids of the form ``functions.NAME:IDX`` are kept; others are replaced by ``functions.NAME:IDX`` with a
conversation-wide counter, and tool results refer to the replaced id.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence, Union

from kimi_jax.tokenizer import Tokenizer

__all__ = [
    "CALL_INDEX_BASE",
    "ChatImage",
    "EFFORT_LEVELS",
    "IMAGE_PART_TYPES",
    "Segment",
    "encode_chat",
    "encode_chat_kimi_linear",
    "escape_attribute",
    "image_part_url",
    "json_type_name",
    "normalize_reasoning_effort",
    "render_chat_segments",
    "render_chat_segments_kimi_linear",
    "segments_to_ids",
    "segments_to_text",
    "unescape_attribute",
]

# A segment: text to tokenise, or the id of a control token.
Segment = Union[str, int]

CALL_INDEX_BASE = 1
EFFORT_LEVELS = ("low", "high", "max")
_EFFORT_ALIASES = {"minimal": "low", "low": "low", "medium": "high", "high": "high", "max": "max", "xhigh": "max"}

K3_CONTROL_NAMES = ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")
K2_CONTROL_NAMES = (
    "<|im_system|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_middle|>",
    "<|im_end|>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
)

_ESCAPES = (("&", "&amp;"), ('"', "&quot;"), ("<", "&lt;"), (">", "&gt;"))

IMAGE_PART_TYPES = ("image_url",)
MEDIA_CONTROL_NAMES = ("<|media_begin|>", "<|media_content|>", "<|media_pad|>", "<|media_end|>")


@dataclass(frozen=True)
class ChatImage:
    """What the prompt needs of one image: its original size in pixels (written as ``image {width}x{height}``) and
    the number of ``<|media_pad|>`` tokens its features fill (``modules.vision.image_token_count`` of its grid)."""

    width: int
    height: int
    num_tokens: int


def image_part_url(part: dict, where: str) -> str:
    """The URL of an OpenAI ``{"type": "image_url", "image_url": {"url": ...}}`` part (a bare string
    ``image_url`` is accepted too; ``detail`` is ignored)."""
    ref = part.get("image_url")
    url = ref.get("url") if isinstance(ref, dict) else ref
    if not isinstance(url, str) or not url:
        raise ValueError(f'{where}: an image_url part needs {{"image_url": {{"url": "..."}}}}')
    return url


def escape_attribute(value: str) -> str:
    """XML-escape an attribute value: ``&`` ``"`` ``<`` ``>``."""
    for raw, ent in _ESCAPES:
        value = value.replace(raw, ent)
    return value


def unescape_attribute(value: str) -> str:
    """Inverse of ``escape_attribute`` (only those four entities; ``&amp;`` last)."""
    for raw, ent in reversed(_ESCAPES):
        value = value.replace(ent, raw)
    return value


def json_type_name(value: Any) -> str:
    """The ``type`` attribute of a tool argument: string / number / boolean / null / object / array."""
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, dict):
        return "object"
    if isinstance(value, (list, tuple)):
        return "array"
    raise ValueError(f"tool argument value of type {type(value).__name__} is not JSON")


def _compact_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def normalize_reasoning_effort(effort: str | None) -> str | None:
    """``None`` -> "max"; OpenAI names mapped onto low / high / max; ``"none"`` -> ``None`` (thinking off)."""
    if effort is None:
        return "max"
    key = str(effort).strip().lower()
    if key == "none":
        return None
    if key not in _EFFORT_ALIASES:
        raise ValueError(f"reasoning_effort {effort!r} not understood; use one of low, high, max (or minimal, medium)")
    return _EFFORT_ALIASES[key]


# A message body: text, and (user messages of the K3 format) images in between.
Body = list  # of str | ChatImage


class _ImageQueue:
    """The caller's ``ChatImage`` list, handed out in the order the image parts appear; checks the count."""

    def __init__(self, images: Optional[Sequence[ChatImage]]):
        self.images = list(images or ())
        self.used = 0

    def take(self, where: str) -> ChatImage:
        if self.used >= len(self.images):
            raise ValueError(f"{where}: an image_url part without its decoded image (the caller passed "
                             f"{len(self.images)} image(s))")
        self.used += 1
        return self.images[self.used - 1]

    def check_all_used(self) -> None:
        if self.used != len(self.images):
            raise ValueError(f"{len(self.images)} image(s) were given for {self.used} image part(s) in the messages")


def _content_body(content: Any, where: str, images: Optional[_ImageQueue] = None) -> Body:
    """The parts of ``content`` as a body: text strings and, where ``images`` is given, ``ChatImage``s for the
    ``image_url`` parts (None: image parts are refused -- messages other than the user's)."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        out: Body = []
        for i, part in enumerate(content):
            if isinstance(part, str):
                out.append(part)
                continue
            if not isinstance(part, dict):
                raise ValueError(f"{where}: content part {i} is not an object")
            ptype = part.get("type", "text")
            if ptype in ("text", "input_text", "output_text"):
                text = part.get("text")
                if not isinstance(text, str):
                    raise ValueError(f"{where}: content part {i} has no 'text' string")
                out.append(text)
            elif ptype in IMAGE_PART_TYPES and images is not None:
                image_part_url(part, f"{where}.content[{i}]")
                out.append(images.take(f"{where}.content[{i}]"))
            elif ptype in IMAGE_PART_TYPES:
                raise ValueError(f"{where}: image parts are only allowed in user messages")
            else:
                raise ValueError(f"{where}: content part type {ptype!r} is not supported (text, and image_url in "
                                 "user messages)")
        return out
    raise ValueError(f"{where}: content must be a string, a list of parts or null, got {type(content).__name__}")


def _content_text(content: Any, where: str) -> str:
    """Text-only content (image parts refused)."""
    return "".join(_content_body(content, where))


def _has_image_part(content: Any) -> bool:
    return isinstance(content, list) and any(isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES
                                             for p in content)


def _reasoning_text(msg: dict) -> str:
    r = msg.get("reasoning_content")
    if r is None:
        r = msg.get("reasoning")
    if r is None:
        return ""
    if not isinstance(r, str):
        raise ValueError("assistant reasoning_content must be a string")
    return r


def _tool_call_fields(call: Any, where: str) -> tuple[str, Any, str | None]:
    """(name, arguments, id) of an OpenAI tool call; arguments as given (str or dict)."""
    if not isinstance(call, dict):
        raise ValueError(f"{where}: tool call must be an object")
    fn = call.get("function", call)
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn.get("name"):
        raise ValueError(f"{where}: tool call needs function.name")
    args = fn.get("arguments", "{}")
    if args is None:
        args = "{}"
    cid = call.get("id")
    return fn["name"], args, (str(cid) if cid is not None else None)


def _parse_args_object(args: Any) -> dict | None:
    """Arguments as a dict when they are (the JSON text of) an object, else ``None``."""
    if isinstance(args, dict):
        return args
    if isinstance(args, str):
        try:
            value = json.loads(args) if args.strip() else {}
        except ValueError:
            return None
        return value if isinstance(value, dict) else None
    return None


def _last_user_index(messages: Sequence[dict]) -> int:
    last = -1
    for i, m in enumerate(messages):
        if isinstance(m, dict) and m.get("role") == "user":
            last = i
    return last


# --------------------------------------------------------------------------------------------------------------------


class _Segments:
    def __init__(self, tokenizer: Tokenizer, control_names: Iterable[str]):
        self.tok = tokenizer
        self.ids = {}
        for name in control_names:
            if not tokenizer.has_token(name):
                raise ValueError(f"tokenizer {tokenizer.name!r} has no control token {name}; wrong chat format?")
            self.ids[name] = tokenizer.token_id(name)
        self.out: list[Segment] = []

    def ctrl(self, name: str) -> None:
        tid = self.ids.get(name)
        if tid is None:
            tid = self.tok.token_id(name)
        self.out.append(tid)

    def text(self, s: str) -> None:
        if not s:
            return
        if self.out and isinstance(self.out[-1], str):
            self.out[-1] += s
        else:
            self.out.append(s)

    def body(self, body: Body) -> None:
        """Text and images: ``<|media_begin|>image {W}x{H}<|media_content|><|media_pad|>×n<|media_end|>``."""
        for piece in body:
            if isinstance(piece, str):
                self.text(piece)
                continue
            self.ctrl("<|media_begin|>")
            self.text(f"image {piece.width}x{piece.height}")
            self.ctrl("<|media_content|>")
            pad = self.ids.get("<|media_pad|>")
            if pad is None:
                pad = self.ids["<|media_pad|>"] = self.tok.token_id("<|media_pad|>")
            self.out.extend([pad] * int(piece.num_tokens))
            self.ctrl("<|media_end|>")


class _K3Writer(_Segments):
    def __init__(self, tokenizer: Tokenizer, escape: bool):
        super().__init__(tokenizer, K3_CONTROL_NAMES)
        self.escape = escape

    def _attrs(self, attrs: Sequence[tuple[str, str]]) -> str:
        parts = []
        for k, v in attrs:
            v = escape_attribute(v) if self.escape else v
            parts.append(f' {k}="{v}"')
        return "".join(parts)

    def open(self, tag: str, *attrs: tuple[str, str]) -> None:
        self.ctrl("<|open|>")
        self.text(tag + self._attrs(attrs))
        self.ctrl("<|sep|>")

    def close(self, tag: str) -> None:
        self.ctrl("<|close|>")
        self.text(tag)
        self.ctrl("<|sep|>")

    def message(self, attrs: Sequence[tuple[str, str]], body: Union[str, Body]) -> None:
        self.open("message", *attrs)
        self.body([body] if isinstance(body, str) else body)
        self.close("message")
        self.ctrl("<|end_of_msg|>")

    def tool_calls(self, calls: Sequence[Any], where: str) -> None:
        self.open("tools")
        for j, call in enumerate(calls):
            name, args, _ = _tool_call_fields(call, f"{where}.tool_calls[{j}]")
            self.open("call", ("tool", name), ("index", str(j + CALL_INDEX_BASE)))
            obj = _parse_args_object(args)
            if obj is not None:
                for key, value in obj.items():
                    vtype = json_type_name(value)
                    self.open("argument", ("key", str(key)), ("type", vtype))
                    self.text(value if vtype == "string" else _compact_json(value))
                    self.close("argument")
            else:
                self.open("json", ("type", "object"))
                self.text(args if isinstance(args, str) else _compact_json(args))
                self.close("json")
            self.close("call")
        self.close("tools")


def render_chat_segments(
    tokenizer: Tokenizer,
    messages: list[dict],
    tools: list[dict] | None = None,
    thinking: bool = True,
    reasoning_effort: str | None = None,
    keep_past_reasoning: bool = False,
    escape_attributes: bool = True,
    add_generation_prompt: bool = True,
    images: Optional[Sequence[ChatImage]] = None,
) -> list[Segment]:
    """The K3 prompt as segments (text strings and control ids); see the module docstring for the format.
    ``images``: one ``ChatImage`` per ``image_url`` part of the user messages, in order."""
    effort = normalize_reasoning_effort(reasoning_effort)
    if effort is None:
        thinking = False
    w = _K3Writer(tokenizer, escape_attributes)
    image_queue = _ImageQueue(images)
    if image_queue.images:  # checked up front: a tokenizer without the media tokens is a clear error
        for name in MEDIA_CONTROL_NAMES:
            if not tokenizer.has_token(name):
                raise ValueError(f"tokenizer {tokenizer.name!r} has no control token {name}: it cannot take images")
    if tools:
        w.message((("role", "system"), ("type", "tool-declare")), "# Tools\n" + _compact_json(list(tools)))
    if thinking:
        w.message((("role", "system"), ("type", "thinking-effort")), effort or "max")

    last_user = _last_user_index(messages)
    call_names: dict[str, str] = {}
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise ValueError(f"{where}: a message must be an object")
        role = msg.get("role")
        if role in ("system", "developer"):
            w.message((("role", "system"),), _content_text(msg.get("content"), where))
        elif role == "user":
            w.message((("role", "user"),), _content_body(msg.get("content"), where, image_queue))
        elif role == "tool":
            name = msg.get("name") or call_names.get(str(msg.get("tool_call_id")))
            attrs = [("role", "tool")] + ([("name", str(name))] if name else [])
            w.message(attrs, _content_text(msg.get("content"), where))
        elif role == "assistant":
            w.open("message", ("role", "assistant"))
            reasoning = _reasoning_text(msg)
            keep = keep_past_reasoning or i > last_user
            if keep and reasoning:
                w.open("think")
                w.text(reasoning)
                w.close("think")
            elif thinking:
                w.open("think")
                w.close("think")
            w.open("response")
            w.text(_content_text(msg.get("content"), where))
            w.close("response")
            calls = msg.get("tool_calls") or []
            if calls:
                for j, call in enumerate(calls):
                    name, _, cid = _tool_call_fields(call, f"{where}.tool_calls[{j}]")
                    if cid is not None:
                        call_names[cid] = name
                w.tool_calls(calls, where)
            w.close("message")
            w.ctrl("<|end_of_msg|>")
        else:
            raise ValueError(f"{where}: unknown role {role!r} (system, developer, user, assistant, tool)")

    image_queue.check_all_used()
    if add_generation_prompt:
        w.open("message", ("role", "assistant"))
        w.open("think" if thinking else "response")
    return w.out


def segments_to_ids(tokenizer: Tokenizer, segments: Iterable[Segment]) -> list[int]:
    """Token ids of segments: text through ``tokenizer.encode``, control ids as they are."""
    ids: list[int] = []
    for seg in segments:
        if isinstance(seg, str):
            ids.extend(tokenizer.encode(seg))
        else:
            ids.append(int(seg))
    return ids


def segments_to_text(tokenizer: Tokenizer, segments: Iterable[Segment]) -> str:
    """Readable form (control ids as their names) -- for logs and tests, never for tokenising."""
    return "".join(s if isinstance(s, str) else (tokenizer.special_name(int(s)) or f"<#{s}>") for s in segments)


def encode_chat(
    tokenizer: Tokenizer,
    messages: list[dict],
    tools: list[dict] | None = None,
    thinking: bool = True,
    reasoning_effort: str | None = None,
    keep_past_reasoning: bool = False,
    escape_attributes: bool = True,
    add_generation_prompt: bool = True,
    images: Optional[Sequence[ChatImage]] = None,
) -> list[int]:
    """Token ids of a K3 chat prompt (``render_chat_segments`` then ``segments_to_ids``)."""
    return segments_to_ids(
        tokenizer,
        render_chat_segments(
            tokenizer,
            messages,
            tools,
            thinking=thinking,
            reasoning_effort=reasoning_effort,
            keep_past_reasoning=keep_past_reasoning,
            escape_attributes=escape_attributes,
            add_generation_prompt=add_generation_prompt,
            images=images,
        ),
    )


# --------------------------------------------------------------------------------------------------------------------
# Kimi-Linear / K2 (<|im_*|>) format

_K2_CALL_ID = re.compile(r"^functions\.[^:\s]+:\d+$")


class _K2Writer(_Segments):
    def __init__(self, tokenizer: Tokenizer):
        super().__init__(tokenizer, K2_CONTROL_NAMES)

    def think_tag(self, tag: str) -> None:
        if self.tok.has_token(tag):
            self.ctrl(tag)
        else:
            self.text(tag)

    def turn(self, opener: str, role_name: str, body: str) -> None:
        self.ctrl(opener)
        self.text(role_name)
        self.ctrl("<|im_middle|>")
        self.text(body)
        self.ctrl("<|im_end|>")


def render_chat_segments_kimi_linear(
    tokenizer: Tokenizer,
    messages: list[dict],
    tools: list[dict] | None = None,
    thinking: bool = False,
    keep_past_reasoning: bool = False,
    add_generation_prompt: bool = True,
) -> list[Segment]:
    """The Kimi-Linear / K2 prompt as segments; see the module docstring."""
    w = _K2Writer(tokenizer)
    if tools:
        w.turn("<|im_system|>", "tool_declare", _compact_json(list(tools)))
    last_user = _last_user_index(messages)
    id_map: dict[str, str] = {}
    counter = 0
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise ValueError(f"{where}: a message must be an object")
        role = msg.get("role")
        if role in ("system", "developer"):
            w.turn("<|im_system|>", "system", _content_text(msg.get("content"), where))
        elif role == "user":
            if _has_image_part(msg.get("content")):
                raise ValueError(f"{where}: the Kimi-Linear / K2 chat format has no image form; images need a K3 "
                                 "model with a vision tower")
            w.turn("<|im_user|>", "user", _content_text(msg.get("content"), where))
        elif role == "tool":
            cid = msg.get("tool_call_id")
            ref = id_map.get(str(cid), str(cid) if cid is not None else "")
            if not ref and msg.get("name"):
                ref = f"functions.{msg['name']}"
            w.turn("<|im_system|>", "tool", f"## Return of {ref}\n" + _content_text(msg.get("content"), where))
        elif role == "assistant":
            w.ctrl("<|im_assistant|>")
            w.text("assistant")
            w.ctrl("<|im_middle|>")
            reasoning = _reasoning_text(msg)
            if (keep_past_reasoning or i > last_user) and reasoning:
                w.think_tag("<think>")
                w.text(reasoning)
                w.think_tag("</think>")
            elif thinking:
                w.think_tag("<think>")
                w.think_tag("</think>")
            w.text(_content_text(msg.get("content"), where))
            calls = msg.get("tool_calls") or []
            if calls:
                w.ctrl("<|tool_calls_section_begin|>")
                for j, call in enumerate(calls):
                    name, args, cid = _tool_call_fields(call, f"{where}.tool_calls[{j}]")
                    if cid is not None and _K2_CALL_ID.match(cid):
                        ref = cid
                    else:
                        ref = f"functions.{name}:{counter}"
                    counter += 1
                    if cid is not None:
                        id_map[cid] = ref
                    w.ctrl("<|tool_call_begin|>")
                    w.text(ref)
                    w.ctrl("<|tool_call_argument_begin|>")
                    w.text(args if isinstance(args, str) else _compact_json(args))
                    w.ctrl("<|tool_call_end|>")
                w.ctrl("<|tool_calls_section_end|>")
            w.ctrl("<|im_end|>")
        else:
            raise ValueError(f"{where}: unknown role {role!r} (system, developer, user, assistant, tool)")
    if add_generation_prompt:
        w.ctrl("<|im_assistant|>")
        w.text("assistant")
        w.ctrl("<|im_middle|>")
        if thinking:
            w.think_tag("<think>")
    return w.out


def encode_chat_kimi_linear(
    tokenizer: Tokenizer,
    messages: list[dict],
    tools: list[dict] | None = None,
    thinking: bool = False,
    keep_past_reasoning: bool = False,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Token ids of a Kimi-Linear / K2 chat prompt."""
    return segments_to_ids(
        tokenizer,
        render_chat_segments_kimi_linear(
            tokenizer,
            messages,
            tools,
            thinking=thinking,
            keep_past_reasoning=keep_past_reasoning,
            add_generation_prompt=add_generation_prompt,
        ),
    )
