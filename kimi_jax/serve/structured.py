"""Structured output: ``response_format`` (``json_object``, ``json_schema``) and vLLM's guided decoding extras
(``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``, or current vLLM's ``structured_outputs``
object with ``json`` / ``regex`` / ``choice`` / ``grammar`` / ``json_object``), through llguidance.

llguidance compiles the JSON schema / regex / Lark grammar and computes, on the host, the bitmask of tokens that keep
the output inside it; ``GrammarPart`` hands that bitmask to the engine as a ``Constraint(bits=...)`` (``guide.py``),
which the sampler applies inside the one compiled decode step -- a structured row shares the batch with free rows.
A mask that allows a single token becomes a forced token (and, under speculative decoding, a certain draft).

Chat (K3 format): the grammar covers the response block's text.  With thinking on, the reasoning is free text until
the model closes it; then ``<|close|>think<|sep|><|open|>response<|sep|>`` is forced, the grammar runs, and the turn
is closed (``<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>``).  When the request has tools (and
``tool_choice`` "auto"), the model may instead leave the response empty and open a tool section, which is free and
parsed as usual: it calls tools or answers in the format.  ``tool_choice`` "required" / a named tool already guides
the turn and cannot be combined with a format (400).  Kimi-Linear / K2 format: the grammar covers the answer, thinking
must be off.  Completions: the grammar covers the generated text from its first token.

The model's raw log-probs are reported as always (before the mask).  A grammar llguidance cannot compile is a 400.
"""

from __future__ import annotations

import copy
import json
import threading
from dataclasses import dataclass
from typing import Any, Optional

import llguidance
import llguidance.numpy as llnp
import numpy as np
from llguidance.gbnf_to_lark import any_to_lark

from ..engine.guide import ONLY_IDS, TEXT, Choice, Constraint, Forced, FreeUntil, ProgramGuide, Text, _Part
from .errors import bad_request

# compact JSON: no free whitespace, so a model cannot wander into endless spaces; separators as json.dumps' compact
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


@dataclass(frozen=True)
class GrammarSpec:
    """An llguidance grammar (its serialized form) and where it came from (the request's parameter name)."""

    grammar: str
    param: str


# ------------------------------------------------------------------------------------------------- request parsing
def _schema(value: Any, param: str) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise bad_request(f"{param} must be a JSON schema (an object or its JSON text)", param) from None
    if not isinstance(value, (dict, bool)):
        raise bad_request(f"{param} must be a JSON schema object", param, "invalid_type")
    return value


def _json_grammar(schema: Any, param: str) -> GrammarSpec:
    try:
        return GrammarSpec(llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS), param)
    except ValueError as e:
        raise bad_request(f"{param}: {e}", param) from None


def _regex_grammar(regex: Any, param: str) -> GrammarSpec:
    if not isinstance(regex, str) or not regex:
        raise bad_request(f"{param} must be a non-empty regular expression string", param, "invalid_type")
    return GrammarSpec(llguidance.LLMatcher.grammar_from_regex(regex), param)


def _choice_grammar(choices: Any, param: str) -> GrammarSpec:
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise bad_request(f"{param} must be a non-empty list of non-empty strings", param, "invalid_type")
    alts = " | ".join(json.dumps(c, ensure_ascii=False) for c in dict.fromkeys(choices))
    return GrammarSpec(llguidance.LLMatcher.grammar_from_lark(f"start: {alts}\n"), param)


def _lark_grammar(text: Any, param: str) -> GrammarSpec:
    if not isinstance(text, str) or not text.strip():
        raise bad_request(f"{param} must be a non-empty grammar (Lark, or GBNF / EBNF as llama.cpp writes it)",
                          param, "invalid_type")
    try:
        lark = any_to_lark(text)
    except Exception as e:  # noqa: BLE001 -- the converter's words about the grammar
        raise bad_request(f"{param}: {e}", param) from None
    return GrammarSpec(llguidance.LLMatcher.grammar_from_lark(lark), param)


def request_grammar(body: dict) -> Optional[GrammarSpec]:
    """The request's output format as a grammar, or None (free text).  At most one source may be given."""
    found: list[GrammarSpec] = []
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict):  # e.g. "text": OpenAI's shape is {"type": "text"}
            raise bad_request(f"'response_format' must be an object such as {{\"type\": \"text\"}}, got "
                              f"{json.dumps(rf)[:80]}", "response_format", "invalid_type")
        kind = rf.get("type")
        if kind == "json_object":
            found.append(_json_grammar({"type": "object"}, "response_format"))
        elif kind == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or "schema" not in js:
                raise bad_request("response_format json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": "
                                  "{...}}}", "response_format")
            found.append(_json_grammar(_schema(js["schema"], "response_format"), "response_format"))
        elif kind not in ("text", None) or kind is None:
            raise bad_request(f"response_format type {kind!r} is not supported (text, json_object, json_schema)",
                              "response_format")
    makers = {"json": _json_grammar, "regex": _regex_grammar, "choice": _choice_grammar, "grammar": _lark_grammar}
    for name in _GUIDED:
        if body.get(name) is not None:
            key = name.removeprefix("guided_")
            value = _schema(body[name], name) if key == "json" else body[name]
            found.append(makers[key](value, name))
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise bad_request("'structured_outputs' must be an object", "structured_outputs", "invalid_type")
        if so.get("structural_tag") is not None:
            raise bad_request("structured_outputs.structural_tag is not supported (json, regex, choice, grammar, "
                              "json_object are)", "structured_outputs", "unsupported")
        for key in ("json", "regex", "choice", "grammar"):
            if so.get(key) is not None:
                value = _schema(so[key], "structured_outputs") if key == "json" else so[key]
                found.append(makers[key](value, "structured_outputs"))
        if so.get("json_object"):
            found.append(_json_grammar({"type": "object"}, "structured_outputs"))
    if len(found) > 1:
        raise bad_request("give one output format: response_format, one guided_* field or one structured_outputs "
                          f"entry (got {', '.join(s.param for s in found)})", found[1].param)
    return found[0] if found else None


# ------------------------------------------------------------------------------------------------- tokenizers
_lltok_lock = threading.Lock()
_lltoks: dict = {}


def lltokenizer(tokenizer, end_id: int, vocab_size: int):
    """llguidance's view of ``tokenizer`` (cached: ~1 s for a 160K vocabulary) with ``end_id`` as its end token --
    the token that may follow a complete grammar (``<|close|>`` in K3 chat, the end-of-turn id elsewhere)."""
    key = (id(tokenizer), int(end_id), int(vocab_size))
    with _lltok_lock:
        lt = _lltoks.get(key)
        if lt is None:
            enc = tokenizer.encoding
            lt = llguidance.LLTokenizer.from_tiktoken(encoder=enc._mergeable_ranks,  # noqa: SLF001
                                                      special_tokens=tokenizer.special_tokens,
                                                      pattern=tokenizer.pat_str, eos_token=int(end_id),
                                                      n_vocab=int(vocab_size))
            _lltoks[key] = (tokenizer, lt)  # the tokenizer is kept alive so that its id is not reused
        else:
            lt = lt[1]
    return lt


def check_grammar(spec: GrammarSpec, lltok) -> None:
    err = llguidance.LLMatcher.validate_grammar(spec.grammar, lltok)
    if err and not err.startswith("WARNING"):
        raise bad_request(f"{spec.param}: the grammar cannot be used: {err}", spec.param)


# ------------------------------------------------------------------------------------------------- the guide part
class GrammarPart(_Part):
    """Tokens the grammar allows (llguidance's bitmask each step) until the grammar is complete and the model
    produces ``end_id`` -- or the grammar admits nothing more, when ``end_id`` is forced -- then the parts ``then``.
    ``empty``: parts that may follow ``end_id`` as the very first token (an empty output instead of the format);
    None: not allowed."""

    def __init__(self, lltok, grammar: str, end_id: int, vocab_size: int, then=(), empty=None,
                 bound: Optional[int] = None):
        self.matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
        if self.matcher.is_error():
            raise ValueError(self.matcher.get_error())
        self.end_id = int(end_id)
        self.V = int(vocab_size)
        self.then = list(then)
        self.empty = None if empty is None else list(empty)
        self.empty_ok = empty is not None
        self.started = False
        self.bound = bound  # what a budget reserves for this part (a grammar itself may have no length bound)

    def constraint(self):
        mask = llnp.allocate_token_bitmask(1, self.V)
        llnp.fill_next_token_bitmask(self.matcher, mask)
        if self.matcher.is_error():
            raise ValueError(f"grammar: {self.matcher.get_error()}")
        words = mask[0]
        if self.empty_ok and not self.started:
            words[self.end_id >> 5] |= np.int32(np.uint32(1 << (self.end_id & 31)).view(np.int32))
        n = int(np.bitwise_count(words.view(np.uint32)).sum())
        if n == 0:  # nothing allowed (should not happen): end the part
            return Constraint(ONLY_IDS, (self.end_id,))
        if n == 1:
            return Constraint(ONLY_IDS, (int(np.flatnonzero(unpack_one(words))[0]),))
        return Constraint(bits=words)

    def advance(self, token_id):
        token_id = int(token_id)
        first = not self.started
        self.started = True
        if token_id == self.end_id:
            if first and self.empty_ok and not self.matcher.is_accepting():
                return True, copy.deepcopy(self.empty)
            if self.matcher.is_accepting():
                return True, copy.deepcopy(self.then)
        if not self.matcher.consume_token(token_id):
            raise ValueError(f"grammar rejected token {token_id}: {self.matcher.get_error()}")
        if self.matcher.is_stopped():
            return True, [Forced([self.end_id])] + copy.deepcopy(self.then)
        return False, []

    def most_tokens(self):
        if self.bound is None:
            raise TypeError("a grammar has no length bound")
        return self.bound + 1  # the end token included

    def __deepcopy__(self, memo):
        other = copy.copy(self)
        other.matcher = self.matcher.deep_copy()
        other.then = copy.deepcopy(self.then, memo)
        other.empty = copy.deepcopy(self.empty, memo)
        return other


def unpack_one(words: np.ndarray) -> np.ndarray:
    return np.unpackbits(np.ascontiguousarray(words).view(np.uint8), bitorder="little").astype(bool)


# ------------------------------------------------------------------------------------------------- guides per use
class StructuredGuideBuilder:
    """Builds a fresh guide per sequence for one request (``guide_factory``); checks the grammar once."""

    def __init__(self, spec: GrammarSpec, tokenizer, vocab_size: int, *, fmt: Optional[str], thinking: bool = False,
                 tools: bool = False, max_tokens: int = 1 << 30):
        self.spec, self.tok, self.V = spec, tokenizer, vocab_size
        self.fmt, self.thinking, self.tools, self.max_tokens = fmt, thinking, tools, max_tokens
        tid = tokenizer.token_id
        if fmt == "k3":
            self.O, self.C, self.S, self.E = tid("<|open|>"), tid("<|close|>"), tid("<|sep|>"), tid("<|end_of_msg|>")
            self.end_id = self.C
        elif fmt == "kimi_linear":
            if thinking:
                raise bad_request("structured output with the Kimi-Linear / K2 chat format needs thinking off "
                                  "(chat_template_kwargs: {\"thinking\": false})", spec.param, "unsupported")
            self.end_id = tid("<|im_end|>")
        else:  # completions
            self.end_id = tokenizer.eos_id
        self.lltok = lltokenizer(tokenizer, self.end_id, vocab_size)
        check_grammar(spec, self.lltok)

    def _k3(self, text: str) -> list[int]:
        return self.tok.encode(text)

    def build(self) -> ProgramGuide:
        if self.fmt != "k3":  # completions, or K2 whose end id <|im_end|> ends the turn
            return ProgramGuide([GrammarPart(self.lltok, self.spec.grammar, self.end_id, self.V)])
        O, C, S, E = self.O, self.C, self.S, self.E
        close_msg = [C] + self._k3("message") + [S, E]
        tools = [O] + self._k3("tools") + [S]
        response_closed = self._k3("response") + [S]  # the <|close|> before it was the grammar's end token
        if self.tools:  # an answer in the format (then maybe tools), or no answer and a tool section
            then = [Forced(response_closed), Choice([(close_msg, []), (tools, [FreeUntil([E])])])]
            empty = [Forced(response_closed + tools), FreeUntil([E])]
        else:
            then, empty = [Forced(response_closed + close_msg)], None
        parts = [GrammarPart(self.lltok, self.spec.grammar, self.end_id, self.V, then, empty)]
        if self.thinking:
            opening = Forced(self._k3("think") + [S, O] + self._k3("response") + [S])
            budget = max(1, self.max_tokens // 2)
            parts = [Text(TEXT, [C], budget), opening] + parts
        return ProgramGuide(parts)
