"""POST /v1/chat/completions (behind the API key): prepare, then stream or answer whole.

The body is prepared in a worker thread (``prepare_chat``: parsed, checked, images loaded, templated, tokenized,
the tool-call or structured-output guide built), then submitted on the event loop.  The chat format's parser turns
the generated pieces into ``content`` / ``reasoning_content`` (alias ``reasoning``) / ``tool_calls``: as deltas when
streaming (``chat_stream``), as one message per choice otherwise (``chat_full``).  ``tool_choice`` required or a
named function guides the turn to a call (K3 format only); with no tools or "none" a call the model writes anyway
is content.  A client that leaves aborts its request.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Optional

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool

from ..engine import EngineError, RequestDone
from ..engine.request import SequenceOutput, apply_event
from .chat_prompt import encode_messages, message_images
from .engine_errors import engine_api_error
from .errors import bad_request
from .parsers import merge_deltas
from .protocol import parse_common, parse_json_body, parse_tools
from .responses import SSEResponse, sse, sse_error, usage
from .state import ServerState, get_state, require_key
from .structured import StructuredGuideBuilder, request_grammar
from .tool_guide import K3ToolCallGuideBuilder

log = logging.getLogger("kimi_jax.serve")

router = APIRouter(dependencies=[Depends(require_key)])


@dataclass
class ChatPlan:
    """A prepared chat request (``prepare_chat``)."""

    ids: list[int]
    params: Any  # SamplingParams
    c: Any  # protocol.Common
    opts: Any  # the chat format's options
    guide_factory: Any
    images: list


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, st: ServerState = Depends(get_state)):
    st.check_ready()  # refused before the body is read and prepared
    plan = await run_in_threadpool(prepare_chat, st, await request.body())
    rid = "chatcmpl-" + uuid.uuid4().hex
    created = int(time.time())
    stream = st.submit(plan.ids, plan.params, plan.c.n, rid, plan.guide_factory, plan.images or None)
    st.drain.track(rid, [stream], [rid])
    if plan.c.stream:
        return SSEResponse(chat_stream(st, stream, rid, created, plan.c, plan.opts), media_type="text/event-stream",
                           headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await chat_full(st, request, stream, rid, created, plan.c, plan.opts)


def prepare_chat(st: ServerState, raw: bytes) -> ChatPlan:
    """A chat request body -> what to submit: parsed, checked, images loaded, templated and tokenized
    (blocking: runs in a worker thread).  Raises ``APIError``."""
    engine, tokenizer = st.engine, st.tokenizer
    body = parse_json_body(raw)
    st.check_model(body)
    fmt = st.chat_format
    if fmt is None:
        raise bad_request(f"{engine.model.config.architecture} has no chat format here; use /v1/completions",
                          "messages", "unsupported")
    c = parse_common(body, vocab_size=engine.vocab_size, chat=True, max_n=engine.B)
    grammar = request_grammar(body)
    tools, tool_choice = parse_tools(body)
    opts = fmt.options(body.get("chat_template_kwargs"), body.get("reasoning_effort"))
    opts = opts.with_tools(tools, tool_choice)  # no tools or tool_choice "none": calls come back as content
    images, chat_images = message_images(st, body.get("messages"))
    ids = encode_messages(st, body.get("messages"), tools if tool_choice != "none" else [], opts, True, chat_images)
    # ids hold every image's <|media_pad|> tokens: the context check counts them
    params = st.fit_max_tokens(c, len(ids), c.max_tokens is not None, "messages")
    guide_factory = None
    if tool_choice == "required" or isinstance(tool_choice, dict):
        if fmt.name != "k3":
            raise bad_request(f"tool_choice {tool_choice!r} (guided tool calls) is only supported for the K3 "
                              "chat format; use 'auto'", "tool_choice", "unsupported")
        builder = K3ToolCallGuideBuilder(tokenizer, tools, thinking=opts.thinking,
                                         escape_attributes=opts.escape_attributes,
                                         max_string_tokens=st.guided_string_max_tokens,
                                         max_tokens=params.max_tokens, vocab_size=engine.vocab_size)
        name = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None
        try:  # built once here, so a schema the guide cannot follow is a 400, not a failure mid-decode
            builder.build(name)
        except ValueError as e:
            raise bad_request(f"cannot guide a call of these tools: {e}", "tools", "unsupported") from None
        guide_factory = lambda: builder.build(name)  # noqa: E731
        if grammar is not None:
            raise bad_request(f"{grammar.param} cannot be combined with tool_choice {tool_choice!r}: that turn is "
                              "already guided to a tool call", grammar.param, "unsupported")
    elif grammar is not None:
        guide_factory = StructuredGuideBuilder(grammar, tokenizer, engine.vocab_size, fmt=fmt.name,
                                               thinking=opts.thinking, tools=opts.tool_calls,
                                               max_tokens=params.max_tokens).build
    return ChatPlan(ids, params, c, opts, guide_factory, images)


async def chat_stream(st: ServerState, stream, rid, created, c, opts):
    """The streamed answer's events: a role chunk per choice, the parsed deltas as they come, each choice's
    finish chunk, the usage chunk when asked, ``[DONE]`` (or an error chunk).  Aborts the request if the client
    leaves first."""
    n = c.n
    parsers = [st.chat_format.new_parser(opts) for _ in range(n)]
    done: Optional[RequestDone] = None
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": st.model_name}
    extra = {"usage": None} if c.include_usage else {}

    def chunk(i, delta, logprobs=None, finish_reason=None, **more):
        ch = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason, **more}
        return sse({**base, "choices": [ch], **extra})

    try:
        for i in range(n):
            yield chunk(i, {"role": "assistant", "content": ""})
        async for ev in stream:
            if isinstance(ev, RequestDone):
                done = ev
                break
            i, p = ev.index, parsers[ev.index]
            deltas = _feed(p, ev.pieces)
            if ev.finish_reason is not None:
                deltas = merge_deltas(deltas + p.finish("length" if ev.finish_reason == "length" else "stop"))
            lp = {"content": chat_logprobs(st, ev.logprobs)} if ev.logprobs else None
            for j, d in enumerate(deltas):
                yield chunk(i, _with_alias(d), lp if j == 0 else None)
            if not deltas and lp is not None:
                yield chunk(i, {}, lp)
            if ev.finish_reason is not None:
                reason = "abort" if ev.finish_reason == "abort" else p.result().finish_reason
                yield chunk(i, {}, None, reason, stop_reason=ev.stop_reason)
        if done is not None and c.include_usage:
            yield sse({**base, "choices": [], "usage": usage(done.num_prompt_tokens, done.num_generated_total,
                                                             done.num_cached_tokens)})
        yield "data: [DONE]\n\n"
    except EngineError as e:
        yield sse_error(e)
    finally:
        st.drain.untrack(rid)
        if done is None and st.engine.alive:
            log.info("%s: client disconnected mid-stream; request aborted", rid)
            st.engine.abort(rid)


async def chat_full(st: ServerState, request: Request, stream, rid, created, c, opts) -> dict:
    """The whole answer once every choice finished (a 503 ``APIError`` if the engine cannot finish it); the
    request is aborted if the client leaves first."""
    n = c.n
    parsers = [st.chat_format.new_parser(opts) for _ in range(n)]
    outs = [SequenceOutput(i) for i in range(n)]
    done = None
    watcher = asyncio.create_task(st.watch_disconnect(request, [rid], rid))
    try:
        async for ev in stream:
            if isinstance(ev, RequestDone):
                done = ev
                break
            apply_event(outs[ev.index], ev)
            _feed(parsers[ev.index], ev.pieces)
            if ev.finish_reason is not None:
                parsers[ev.index].finish("length" if ev.finish_reason == "length" else "stop")
    except EngineError as e:
        raise engine_api_error(e) from None
    finally:
        st.drain.untrack(rid)
        watcher.cancel()
        if done is None:
            st.engine.abort(rid)
    choices = []
    for i in range(n):
        res = parsers[i].result()
        msg = res.to_openai()
        msg.setdefault("reasoning_content", None)
        msg["reasoning"] = msg["reasoning_content"]
        reason = "abort" if outs[i].finish_reason == "abort" else res.finish_reason
        choices.append({"index": i, "message": msg,
                        "logprobs": {"content": chat_logprobs(st, outs[i].logprobs)} if c.params.logprobs else None,
                        "finish_reason": reason, "stop_reason": outs[i].stop_reason})
    return {"id": rid, "object": "chat.completion", "created": created, "model": st.model_name,
            "choices": choices,
            "usage": usage(done.num_prompt_tokens, done.num_generated_total, done.num_cached_tokens)}


def chat_logprobs(st: ServerState, lps) -> list[dict]:
    """Chat's ``logprobs.content``: per token its string, log-prob, bytes and ``top_logprobs``."""
    return [{"token": st.token_str(x.token_id), "logprob": x.logprob, "bytes": st.token_bytes(x.token_id),
             "top_logprobs": [{"token": st.token_str(t), "logprob": lp, "bytes": st.token_bytes(t)}
                              for t, lp in x.top]}
            for x in lps]


def _with_alias(delta: dict) -> dict:
    if "reasoning_content" in delta:
        delta = dict(delta)
        delta["reasoning"] = delta["reasoning_content"]
    return delta


def _feed(parser, pieces) -> list[dict]:
    out = []
    for p in pieces:
        out += parser.feed_text(p) if isinstance(p, str) else parser.feed_control(p)
    return out
