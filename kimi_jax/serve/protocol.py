"""Request parsing and validation for the OpenAI-compatible endpoints.

Bodies are read as plain JSON and checked here field by field (no schema library), so every problem becomes a 400
with an OpenAI-style error naming the parameter.  Unknown fields are ignored (as vLLM does); known ones are type- and
range-checked.  Supported beyond OpenAI (vLLM names): ``top_k``, ``min_p``, ``repetition_penalty``,
``stop_token_ids``, ``ignore_eos``, ``min_tokens``, ``include_stop_str_in_output``, ``skip_special_tokens``,
``chat_template_kwargs``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from ..engine.sampling_params import MAX_TOP_LOGPROBS, ParamError, SamplingParams, as_stop_tuple
from .errors import APIError, bad_request

MAX_N = 16
MAX_JSON_DEPTH = 64  # objects / arrays inside one another; requests with tool schemas need a dozen
_MISSING = object()


def json_depth_exceeds(value, limit: int) -> bool:
    """Whether ``value`` (parsed JSON) nests objects / arrays more than ``limit`` deep (iterative: no recursion)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def parse_json_body(raw: bytes) -> dict:
    """A request body -> its JSON object; a 400 naming the problem (never the parser's internals) otherwise."""
    if not raw:
        raise bad_request("the request body is empty; expected a JSON object", None, "invalid_json")
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as e:
        raise bad_request(f"the request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}", None,
                          "invalid_json") from None
    except UnicodeDecodeError:
        raise bad_request("the request body is not valid UTF-8 JSON", None, "invalid_json") from None
    except RecursionError:
        raise _too_deep() from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", None, "invalid_json")
    if json_depth_exceeds(body, MAX_JSON_DEPTH):
        raise _too_deep()
    return body


def _too_deep() -> APIError:
    return bad_request(f"the request body nests objects / arrays more than {MAX_JSON_DEPTH} deep", None,
                       "invalid_json")


def _type_error(name: str, what: str, value: Any) -> APIError:
    return bad_request(f"'{name}' must be {what}, got {json.dumps(value)[:80]}", name, "invalid_type")


def opt_bool(d: dict, name: str, default: Optional[bool] = None) -> Optional[bool]:
    v = d.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _type_error(name, "a boolean", v)
    return v


def opt_int(d: dict, name: str, default: Optional[int] = None) -> Optional[int]:
    v = d.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer() and math.isfinite(v):
            return int(v)
        raise _type_error(name, "an integer", v)
    return v


def opt_number(d: dict, name: str, default: Optional[float] = None) -> Optional[float]:
    v = d.get(name)
    if v is None:
        return default
    try:  # an int too large for a float overflows here
        f = None if isinstance(v, bool) or not isinstance(v, (int, float)) else float(v)
    except OverflowError:
        f = None
    if f is None or not math.isfinite(f):
        raise _type_error(name, "a finite number", v)
    return f


def opt_str(d: dict, name: str, default: Optional[str] = None) -> Optional[str]:
    v = d.get(name)
    if v is None:
        return default
    if not isinstance(v, str):
        raise _type_error(name, "a string", v)
    return v


@dataclass
class Common:
    """Fields shared by chat and completions."""

    model: Optional[str]
    stream: bool
    include_usage: bool
    n: int
    params: SamplingParams
    max_tokens: Optional[int]  # as requested (None: up to the context end, or the endpoint default)
    extra: dict = field(default_factory=dict)
    max_tokens_param: str = "max_tokens"  # the request's name for it (chat: max_completion_tokens when given)


def parse_common(d: dict, *, vocab_size: int, chat: bool, max_n: int = MAX_N) -> Common:
    model = d.get("model")
    if model is not None and not isinstance(model, str):
        raise _type_error("model", "a string", model)
    stream = opt_bool(d, "stream", False)
    so = d.get("stream_options")
    include_usage = False
    if so is not None:
        if not isinstance(so, dict):
            raise _type_error("stream_options", "an object", so)
        if not stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        include_usage = opt_bool(so, "include_usage", False)
    n = opt_int(d, "n", 1)
    if not 1 <= n <= max_n:
        raise bad_request(f"n must be between 1 and {max_n}, got {n}", "n")
    if chat:
        max_tokens = opt_int(d, "max_completion_tokens")
        if max_tokens is None:
            max_tokens = opt_int(d, "max_tokens")
        name_mt = "max_completion_tokens" if d.get("max_completion_tokens") is not None else "max_tokens"
    else:
        max_tokens = opt_int(d, "max_tokens", 16)
        name_mt = "max_tokens"
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"{name_mt} must be at least 1, got {max_tokens}", name_mt)

    top_k = opt_int(d, "top_k", 0)
    if top_k == -1:
        top_k = 0
    bias_raw = d.get("logit_bias")
    bias: dict[int, float] = {}
    if bias_raw is not None:
        if not isinstance(bias_raw, dict):
            raise _type_error("logit_bias", "an object mapping token ids to numbers", bias_raw)
        for k, v in bias_raw.items():
            try:
                tid = int(k)
            except (TypeError, ValueError):
                raise bad_request(f"logit_bias key {k!r} is not a token id", "logit_bias") from None
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise bad_request(f"logit_bias value for {k!r} must be a number", "logit_bias")
            bias[tid] = v  # range-checked by SamplingParams.validate (a float() here could overflow)
    try:
        stop = as_stop_tuple(d.get("stop"))
    except ParamError as e:
        raise bad_request(str(e), "stop") from None
    stop_ids = d.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or any(isinstance(x, bool) or not isinstance(x, int) for x in stop_ids):
        raise _type_error("stop_token_ids", "a list of integers", stop_ids)
    seed = opt_int(d, "seed")

    if chat:
        logprobs = opt_bool(d, "logprobs", False)
        top_logprobs = opt_int(d, "top_logprobs")
        if top_logprobs is not None and not logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        top_logprobs = top_logprobs or 0
    else:
        lp = opt_int(d, "logprobs")
        logprobs = lp is not None
        top_logprobs = lp or 0
        if lp is not None and not 0 <= lp <= MAX_TOP_LOGPROBS:
            raise bad_request(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {lp}", "logprobs")
    try:
        params = SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else 1 << 30,  # set per prompt later
            temperature=opt_number(d, "temperature", 1.0),
            top_p=opt_number(d, "top_p", 1.0),
            top_k=top_k,
            min_p=opt_number(d, "min_p", 0.0),
            seed=seed,
            presence_penalty=opt_number(d, "presence_penalty", 0.0),
            frequency_penalty=opt_number(d, "frequency_penalty", 0.0),
            repetition_penalty=opt_number(d, "repetition_penalty", 1.0),
            logit_bias=bias,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            stop=stop,
            stop_token_ids=tuple(stop_ids),
            include_stop_str_in_output=opt_bool(d, "include_stop_str_in_output", False),
            ignore_eos=opt_bool(d, "ignore_eos", False),
            min_tokens=opt_int(d, "min_tokens", 0),
        ).validate(vocab_size)
    except ParamError as e:
        raise bad_request(str(e), e.param) from None
    return Common(model, stream, include_usage, n, params, max_tokens, max_tokens_param=name_mt)


def parse_tools(d: dict) -> tuple[list[dict], Any]:
    """(tools, tool_choice) checked: tools are ``{"type": "function", "function": {"name", ...}}``."""
    tools = d.get("tools")
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise _type_error("tools", "a list", tools)
    names = set()
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"), dict):
            raise bad_request(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}", "tools")
        name = t["function"].get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"tools[{i}].function.name must be a non-empty string", "tools")
        params = t["function"].get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        names.add(name)
    choice = d.get("tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise bad_request(f"tool_choice must be none, auto, required or a function, got {choice!r}",
                              "tool_choice")
        if choice == "required" and not tools:
            raise bad_request("tool_choice 'required' needs tools", "tool_choice")
    elif isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type", "function") != "function" or not isinstance(name, str):
            raise bad_request('tool_choice must look like {"type": "function", "function": {"name": ...}}',
                              "tool_choice")
        if name not in names:
            raise bad_request(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    else:
        raise _type_error("tool_choice", "a string or an object", choice)
    return [dict(t, type="function") for t in tools], choice
