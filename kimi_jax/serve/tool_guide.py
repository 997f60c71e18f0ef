"""``tool_choice="required"`` or a named function: guided decoding that makes the model call a tool (K3 format).

The guide (``kimi_jax.engine.guide``) writes the structure of one K3 tool call with canonical tokens -- exactly the
ids ``encode_chat`` produces for an assistant turn with that call -- and lets the model choose what is free:

    [thinking on]  reasoning in text tokens until the model closes it (no end-of-message; <|close|> forced once
                   only the call's longest form still fits in ``max_tokens``), then "think<|sep|>" and an empty
                   response block
    [thinking off] "<|close|>response<|sep|>" (the prompt opened the response block)
    <|open|>tools<|sep|>
    <|open|>call tool="NAME" index="1"<|sep|>        NAME: the named tool, or the model picks among all tools
      per argument (the schema's ``required`` properties, else all ``properties``, in schema order):
      <|open|>argument key="K" type="T"<|sep|> VALUE <|close|>argument<|sep|>
    <|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>

VALUE by JSON-schema type: ``enum`` -> one of the values; string -> ordinary text tokens (no control tokens) until the
model closes the argument, at most ``max_string_tokens``; integer / number -> digit tokens (no leading zero, at most
``max_number_tokens``); boolean -> true / false; null -> null; object / array -> compact JSON that follows the argument's own schema
(llguidance, ``structured.GrammarPart``; at most ``max_string_tokens`` of them are reserved in the budget).  The
server's K3 parser turns the result into OpenAI ``tool_calls`` exactly as for a free call.
"""

from __future__ import annotations

import json
from typing import Any, Optional, Sequence

import llguidance

from ..engine.guide import DIGITS, NUMBER_START, TEXT, Choice, Forced, ProgramGuide, Text, most_tokens
from .chat import CALL_INDEX_BASE, escape_attribute, json_type_name
from .structured import JSON_OPTIONS, GrammarPart, GrammarSpec, check_grammar, lltokenizer

_TYPE_ATTR = {"string": "string", "integer": "number", "number": "number", "boolean": "boolean", "null": "null",
              "object": "object", "array": "array"}


class K3ToolCallGuideBuilder:
    def __init__(self, tokenizer, tools: Sequence[dict], *, thinking: bool, escape_attributes: bool = True,
                 max_string_tokens: int = 256, max_number_tokens: int = 4, max_tokens: int = 1 << 30,
                 vocab_size: Optional[int] = None):
        self.tok = tokenizer
        self.tools = [t["function"] for t in tools]
        self.thinking = thinking
        self.escape = escape_attributes
        self.max_string_tokens = max_string_tokens
        self.max_number_tokens = max_number_tokens
        self.max_tokens = max_tokens  # the request's completion budget: reasoning gets what the call leaves
        tid = tokenizer.token_id
        self.O, self.C, self.S, self.E = tid("<|open|>"), tid("<|close|>"), tid("<|sep|>"), tid("<|end_of_msg|>")
        self.V = vocab_size or tokenizer.vocab_size
        self._lltok = None

    # ---------------------------------------------------------------- token helpers
    def _text(self, s: str) -> list[int]:
        return self.tok.encode(s)

    def _attr(self, v: str) -> str:
        return escape_attribute(v) if self.escape else v

    def _open(self, header: str) -> list[int]:
        return [self.O] + self._text(header) + [self.S]

    def _close(self, tag: str) -> list[int]:
        return [self.C] + self._text(tag) + [self.S]

    # ---------------------------------------------------------------- parts
    def _value_parts(self, schema: Any, head) -> list:
        """Parts that write an argument's header ``head(type attribute)``, its value and the <|close|> after it."""
        schema = schema if isinstance(schema, dict) else {}
        C = self.C
        enum = schema.get("enum")
        if isinstance(enum, list) and enum:
            opts = []
            for v in enum:
                try:
                    vtype = json_type_name(v)
                except ValueError:
                    continue
                text = v if isinstance(v, str) else json.dumps(v, ensure_ascii=False, separators=(",", ":"))
                opts.append((vtype, self._text(text) + [C]))
            if opts:  # each value with its own type attribute: enum [1, "auto", null] keeps 1 a number
                return [Choice([(head(vtype) + ids, []) for vtype, ids in opts])]
        stype = schema.get("type")
        if isinstance(stype, list):
            stype = next((t for t in stype if t != "null"), "string")
        attr = _TYPE_ATTR.get(stype, "string")
        if stype in ("integer", "number"):
            value = Text(DIGITS, [C], self.max_number_tokens, min_tokens=1, first_class=NUMBER_START)
        elif stype == "boolean":
            value = Choice([(self._text("true") + [C], []), (self._text("false") + [C], [])])
        elif stype == "null":
            value = Forced(self._text("null") + [C])
        elif stype in ("object", "array"):
            value = self._json_value(schema, stype)
        else:
            attr, value = "string", Text(TEXT, [C], self.max_string_tokens)
        return [Forced(head(attr)), value]

    def _json_value(self, schema: dict, stype: str):
        """A JSON object / array argument following its schema, ended by the argument's <|close|>."""
        if self._lltok is None:
            self._lltok = lltokenizer(self.tok, self.C, self.V)
        sub = dict(schema, type=stype)
        grammar = llguidance.LLMatcher.grammar_from_json_schema(sub, overrides=JSON_OPTIONS)
        check_grammar(GrammarSpec(grammar, "tools"), self._lltok)
        return GrammarPart(self._lltok, grammar, self.C, self.V, bound=self.max_string_tokens)

    def _call_parts(self, fn: dict) -> list:
        params = fn.get("parameters") if isinstance(fn.get("parameters"), dict) else {}
        props = params.get("properties") if isinstance(params.get("properties"), dict) else {}
        required = params.get("required")
        if isinstance(required, list) and required:
            keys = [k for k in props if k in required] + [k for k in required if k not in props and isinstance(k, str)]
        else:
            keys = list(props)
        parts: list = []
        for key in keys:
            def head(vtype, key=key):
                return self._open(f'argument key="{self._attr(key)}" type="{vtype}"')
            parts += self._value_parts(props.get(key, {}), head)
            parts.append(Forced(self._text("argument") + [self.S]))
        parts.append(Forced(self._close("call")))
        return parts

    def build(self, name: Optional[str] = None) -> ProgramGuide:
        """A guide forcing one call of tool ``name`` (None: any of the declared tools)."""
        fns = [f for f in self.tools if name is None or f.get("name") == name]
        if not fns:
            raise ValueError(f"no declared tool named {name!r}")
        options = []
        for f in fns:
            header = f'call tool="{self._attr(f["name"])}" index="{CALL_INDEX_BASE}"'
            options.append((self._open(header), self._call_parts(f)))
        call = [Forced(self._open("tools")), Choice(options),
                Forced(self._close("tools") + self._close("message") + [self.E])]
        if not self.thinking:
            return ProgramGuide([Forced(self._close("response"))] + call)
        # reasoning: text tokens (no end-of-message: the call must come) until the model closes it, forced closed
        # when only the call's longest form still fits in max_tokens
        after = [Forced(self._text("think") + [self.S] + self._open("response") + self._close("response"))] + call
        budget = max(0, self.max_tokens - 1 - most_tokens(after))  # 1: the <|close|> that ends the reasoning
        return ProgramGuide([Text(TEXT, [self.C], budget)] + after)

