"""Which chat format a served model speaks: prompt encoding + output parser, picked from the architecture.

* K3 family (``kimi_k3``, ``kimi_k31``; also the ``tiny`` preset): ``encode_chat`` / ``K3OutputParser``.  Thinking is
  on by default (the generation prompt opens a ``think`` block); ``chat_template_kwargs={"thinking": false}`` or
  ``reasoning_effort="none"`` turn it off; ``reasoning_effort`` low / high / max (OpenAI names mapped) sets the
  thinking-effort system message.
* Kimi-Linear / K2 (``kimi_linear``): ``encode_chat_kimi_linear`` / ``KimiLinearOutputParser``; thinking off by
  default (``<think>`` opened in the prompt when on); ``reasoning_effort`` other than "none" is accepted and ignored.
* DeepSeek-V3.2 (``deepseek_v32``), when the tokenizer has its ``<｜User｜>`` / ``<｜Assistant｜>`` control tokens:
  ``encode_chat_dsv32`` / ``DSV32OutputParser`` (``chat_dsv32.py``, DSML tool calls); thinking off by default.
* Anything else: no chat format; /v1/completions still works.

``chat_template_kwargs`` also takes ``keep_past_reasoning`` (bool) and, for K3, ``escape_attributes`` (bool) --
the two choices docs/model.md §11 leaves open (see ``chat.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional

from .chat import encode_chat, encode_chat_kimi_linear, normalize_reasoning_effort
from .chat_dsv32 import ASSISTANT, USER, DSV32OutputParser, encode_chat_dsv32
from .errors import bad_request
from .parsers import K3OutputParser, KimiLinearOutputParser

K3_ARCHS = ("kimi_k3", "kimi_k31")
K2_ARCHS = ("kimi_linear",)


@dataclass(frozen=True)
class ChatOptions:
    thinking: bool
    reasoning_effort: Optional[str]
    keep_past_reasoning: bool = False
    escape_attributes: bool = True
    # whether the request lets the model call tools (tools given and tool_choice not "none"); when not, a tool-call
    # section the model writes anyway comes back as content text, never as tool_calls (OpenAI's contract)
    tool_calls: bool = True
    # the request's tools ({"type": "function", "function": {...}}): the K2 parser resolves a bare-counter call id
    tools: tuple = field(default=(), compare=False)

    def with_tools(self, tools, tool_choice) -> "ChatOptions":
        return replace(self, tool_calls=bool(tools) and tool_choice != "none", tools=tuple(tools or ()))


class ChatFormat:
    name = "none"
    default_thinking = False

    def __init__(self, tokenizer):
        self.tok = tokenizer

    def options(self, chat_template_kwargs: Optional[dict], reasoning_effort: Any) -> ChatOptions:
        kw = chat_template_kwargs or {}
        if not isinstance(kw, dict):
            raise bad_request("chat_template_kwargs must be an object", "chat_template_kwargs")
        known = {"thinking", "enable_thinking", "keep_past_reasoning", "escape_attributes"}
        unknown = sorted(set(kw) - known)
        if unknown:
            raise bad_request(f"chat_template_kwargs: unknown keys {unknown}; supported: {sorted(known)}",
                              "chat_template_kwargs")
        thinking = kw.get("thinking", kw.get("enable_thinking", self.default_thinking))
        for key in ("thinking", "enable_thinking", "keep_past_reasoning", "escape_attributes"):
            if key in kw and not isinstance(kw[key], bool):
                raise bad_request(f"chat_template_kwargs.{key} must be a boolean", "chat_template_kwargs")
        if reasoning_effort is not None and not isinstance(reasoning_effort, str):
            raise bad_request("reasoning_effort must be a string", "reasoning_effort")
        try:
            effort = normalize_reasoning_effort(reasoning_effort)
        except ValueError as e:
            raise bad_request(str(e), "reasoning_effort") from None
        if effort is None:  # "none"
            thinking = False
        return ChatOptions(bool(thinking), reasoning_effort, bool(kw.get("keep_past_reasoning", False)),
                           bool(kw.get("escape_attributes", True)))

    def encode(self, messages, tools, opts: ChatOptions, add_generation_prompt: bool = True, images=()) -> list[int]:
        """Prompt ids; ``images``: a ``chat.ChatImage`` per image part of the user messages, in order."""
        raise NotImplementedError

    def new_parser(self, opts: ChatOptions):
        raise NotImplementedError


class K3Format(ChatFormat):
    name = "k3"
    default_thinking = True

    def encode(self, messages, tools, opts, add_generation_prompt=True, images=()):
        return encode_chat(self.tok, messages, tools or None, thinking=opts.thinking,
                           reasoning_effort=opts.reasoning_effort if opts.thinking else None,
                           keep_past_reasoning=opts.keep_past_reasoning, escape_attributes=opts.escape_attributes,
                           add_generation_prompt=add_generation_prompt, images=images)

    def new_parser(self, opts):
        return K3OutputParser(self.tok, thinking=opts.thinking, unescape_attributes=opts.escape_attributes,
                              tool_calls=opts.tool_calls)


class KimiLinearFormat(ChatFormat):
    name = "kimi_linear"
    default_thinking = False

    def encode(self, messages, tools, opts, add_generation_prompt=True, images=()):
        if images:
            raise ValueError("the Kimi-Linear / K2 chat format has no image form")
        return encode_chat_kimi_linear(self.tok, messages, tools or None, thinking=opts.thinking,
                                       keep_past_reasoning=opts.keep_past_reasoning,
                                       add_generation_prompt=add_generation_prompt)

    def new_parser(self, opts):
        return KimiLinearOutputParser(self.tok, in_reasoning=opts.thinking, tool_calls=opts.tool_calls,
                                      tools=opts.tools)


class DeepSeekV32Format(ChatFormat):
    name = "deepseek_v32"
    default_thinking = False

    def encode(self, messages, tools, opts, add_generation_prompt=True, images=()):
        if images:
            raise ValueError("the DeepSeek-V3.2 chat format has no image form")
        return encode_chat_dsv32(self.tok, messages, tools or None, thinking=opts.thinking)

    def new_parser(self, opts):
        return DSV32OutputParser(self.tok, thinking=opts.thinking, tool_calls=opts.tool_calls)


def chat_format_for(architecture: str, tokenizer) -> Optional[ChatFormat]:
    if architecture in K3_ARCHS:
        return K3Format(tokenizer)
    if architecture in K2_ARCHS:
        return KimiLinearFormat(tokenizer)
    if architecture == "deepseek_v32" and tokenizer.has_token(USER) and tokenizer.has_token(ASSISTANT):
        return DeepSeekV32Format(tokenizer)
    return None


def tokenizer_family(architecture: str) -> str:
    return "k2" if architecture in K2_ARCHS else "k3"
