"""The OpenAI-compatible HTTP API (FastAPI) over an ``Engine``.

Endpoints
  POST /v1/chat/completions   chat (stream or not); reasoning as ``reasoning_content`` (alias ``reasoning``); tool calls
                              parsed into ``tool_calls`` (streamed as deltas); ``tool_choice`` none / auto / required /
                              a named function (the last two guided, K3 format; with no tools or "none" a call the
                              model writes anyway is content, never ``tool_calls``); n, logprobs, top_logprobs, seed,
                              stop, logit_bias, penalties; ``stream_options.include_usage``
  POST /v1/completions        text completion: prompt as a string, a list of strings, token ids or lists of ids
  GET  /v1/models             the served model
  POST /tokenize, /detokenize vLLM-style helpers (a prompt string or chat messages -> ids; ids -> text)
  GET  /tokenizer_info        vLLM's shape, for lm-eval's remote tokenizer (``routes_tokenizer.py``)
  GET  /health                200 while the engine runs, 503 once it died
  GET  /metrics               Prometheus text (``metrics.py``)
  GET  /stats                 the engine's counters as JSON (free slots, compilations, ...)

Images: user messages may hold ``{"type": "image_url", "image_url": {"url": ...}}`` parts (data URLs, or http(s)
fetched off the event loop; ``images.py``) when the model has a vision tower and speaks the K3 chat format; each
becomes its media block with one ``<|media_pad|>`` per image token, so usage and the context check count them.

Errors are OpenAI-shaped ``{"error": {"message", "type", "param", "code"}}``: 400 for malformed JSON, bad parameters
and prompts longer than the context, and JSON nested too deep; 401 for a missing / wrong bearer key when the server
has one (``/v1/*``, ``/tokenize``, ``/detokenize``, ``/docs``, ``/redoc``, ``/openapi.json``); 404 for an unknown
model or route; 413 for a body above ``max_request_bytes`` (``limits.BodySizeLimit``); 429 with ``Retry-After`` when
``max_queued_requests`` requests already wait (``limits.QueueLimit``); 503 when the engine is dead, rebuilding its
state after a failed step (``Retry-After``), or the server is shutting down (``lifecycle.Drain``).  No error body
carries an exception's text or other internals: a 500 says only "internal server error" (the log has the rest).

Request preparation -- JSON parsing, validation, image loading, chat templating, tokenization -- runs in a worker
thread (``run_in_threadpool``), so a large body never stalls the event loop: running streams and /health go on.

A client that disconnects stops its request: streaming responses watch for the disconnect and abort the engine
request (its slots are freed on the next engine iteration); non-streaming requests poll for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Optional

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import EngineError, RequestDone
from ..engine.prompt_logprobs import PromptScorer
from ..engine.request import SequenceOutput, apply_event
from .engine_errors import engine_api_error
from .errors import INTERNAL_ERROR, APIError, bad_request, error_body
from .formats import ChatFormat, chat_format_for
from .images import ImageFetchConfig
from .lifecycle import Drain
from .limits import DEFAULT_MAX_QUEUED_REQUESTS, DEFAULT_MAX_REQUEST_BYTES, BodySizeLimit, QueueLimit
from .metrics import ServerMetrics
from .prompt_report import PromptReport, merge_logprobs, parse_prompt_logprobs
from .protocol import opt_bool, parse_common, parse_json_body
from .responses import SSEResponse, sse, sse_error, usage
from . import routes_chat, routes_health, routes_tokenizer
from .state import ServerState, require_key
from .structured import StructuredGuideBuilder, request_grammar

log = logging.getLogger("kimi_jax.serve")


def _docs_routes(app: FastAPI, dependencies: list) -> None:
    """/openapi.json, /docs and /redoc behind ``dependencies`` (the API key check).  The browser pages fetch the
    schema without the key; send it yourself (e.g. curl /openapi.json with the header) where a key is set."""

    @app.get("/openapi.json", include_in_schema=False, dependencies=dependencies)
    async def openapi():
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False, dependencies=dependencies)
    async def docs():
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} - docs")

    @app.get("/redoc", include_in_schema=False, dependencies=dependencies)
    async def redoc():
        return get_redoc_html(openapi_url="/openapi.json", title=f"{app.title} - ReDoc")


@dataclass
class _CompletionPlan:
    """A prepared completions request (``prepare_completion``): (ids, SamplingParams) per prompt."""

    prompts: list
    c: Any
    echo_texts: list[str]
    skip_special: bool
    reports: list = None  # a prompt_report.PromptReport per prompt when echo / prompt_logprobs ask for one
    echo_logprobs: bool = False  # the choices' logprobs start with the prompt's tokens
    prompt_k: Optional[int] = None  # vLLM's prompt_logprobs
    generate: bool = True  # False for max_tokens 0: the prompt is reported, nothing is generated
    guide_factory: Any = None  # structured output (``structured.py``)


def build_app(engine, tokenizer, *, model_name: str, api_key: Optional[str] = None,
              chat_format: Optional[ChatFormat] = None, guided_string_max_tokens: int = 256,
              image_fetch: Optional[ImageFetchConfig] = None,
              max_request_bytes: Optional[int] = DEFAULT_MAX_REQUEST_BYTES,
              max_queued_requests: Optional[int] = DEFAULT_MAX_QUEUED_REQUESTS,
              drain: Optional[Drain] = None) -> FastAPI:
    """The FastAPI app for a started engine.  ``guided_string_max_tokens`` caps a string argument of a forced tool
    call (``tool_choice`` required / named) in case the model never closes it.  ``image_fetch``: limits on image
    parts (fetch timeout, sizes, whether http(s) URLs are fetched at all, private destinations).
    ``max_request_bytes``: larger bodies get a 413 (None: no limit).  ``max_queued_requests``: requests waiting for
    the engine beyond which new ones get a 429 (None: no limit).  ``drain``: the shutdown state the server's signal
    handler drives (``lifecycle.DrainingServer``); default a fresh one that never drains."""
    fmt = chat_format if chat_format is not None else chat_format_for(engine.model.config.architecture, tokenizer)
    metrics = ServerMetrics(engine, model_name)
    drain = drain if drain is not None else Drain()
    # prompt log-probs (a program per length bucket; on every process of a multi-process server)
    scorer = PromptScorer(engine.model, engine.max_model_len, engine.mirror)
    st = ServerState(engine=engine, tokenizer=tokenizer, model_name=model_name, chat_format=fmt,
                     api_key=api_key or None, metrics=metrics, created=int(time.time()),
                     image_fetch=image_fetch or ImageFetchConfig(), guided_string_max_tokens=guided_string_max_tokens,
                     drain=drain, queue_limit=QueueLimit(engine, max_queued_requests), scorer=scorer)
    docs_open = st.api_key is None  # with a key, the schema and its pages are behind it too (`_docs_routes`)
    app = FastAPI(title="kimi_jax", description="OpenAI-compatible server for kimi_jax models", version="0.1.0",
                  docs_url="/docs" if docs_open else None, redoc_url="/redoc" if docs_open else None,
                  openapi_url="/openapi.json" if docs_open else None)
    if max_request_bytes is not None:
        app.add_middleware(BodySizeLimit, max_bytes=max_request_bytes)
    app.state.kimi = st
    app.state.drain = drain

    # -------------------------------------------------------------------------------------------- errors
    @app.exception_handler(APIError)
    async def _api_error(req: Request, e: APIError):
        # the access log shows only the status; say why (a client's 4xx at info, a 5xx as a warning)
        log.log(logging.WARNING if e.status >= 500 else logging.INFO, "%s %s -> %d %s: %s", req.method,
                req.url.path, e.status, e.code or e.type, e.message)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(req: Request, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        msg = str(e.detail)
        if e.status_code == 405 and e.headers and e.headers.get("Allow"):
            msg = f"{req.method} is not allowed on {req.url.path}; use {e.headers['Allow']}"
        return JSONResponse(error_body(msg, "invalid_request_error", None, code), status_code=e.status_code,
                            headers=e.headers)  # a 405 keeps its Allow header

    @app.exception_handler(Exception)
    async def _internal(req: Request, e: Exception):
        log.error("%s %s -> 500: internal error", req.method, req.url.path, exc_info=e)
        return JSONResponse(error_body(INTERNAL_ERROR, "server_error", None, None), status_code=500)

    v1 = APIRouter(dependencies=[Depends(require_key)])
    if not docs_open:
        _docs_routes(app, [Depends(require_key)])
    app.include_router(routes_health.router)
    app.include_router(routes_health.models_router)
    app.include_router(routes_tokenizer.router)
    app.include_router(routes_chat.router)

    # -------------------------------------------------------------------------------------------- completions
    @v1.post("/v1/completions")
    async def completions(request: Request):
        st.check_ready()  # refused before the body is read and prepared
        plan = await run_in_threadpool(prepare_completion, await request.body())
        c = plan.c
        rid = "cmpl-" + uuid.uuid4().hex
        created = int(time.time())
        if not plan.generate:  # max_tokens 0: the prompt only
            if c.stream:
                return SSEResponse(prompt_only_stream(plan, rid, created), media_type="text/event-stream",
                                   headers={"Cache-Control": "no-cache"})
            return prompt_only_response(plan, rid, created)
        rids = [f"{rid}-{k}" for k in range(len(plan.prompts))]
        streams = []
        try:
            for (ids, params), sub_id in zip(plan.prompts, rids):
                streams.append(st.submit(ids, params, c.n, sub_id, plan.guide_factory))
        except Exception:  # a later prompt refused: the ones already submitted must not run on unseen
            for sub_id in rids[:len(streams)]:
                engine.abort(sub_id)
            raise
        st.drain.track(rid, streams, rids)
        if c.stream:
            return SSEResponse(completion_stream(streams, rids, rid, created, c, plan),
                               media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await completion_full(request, streams, rids, rid, created, c, plan)

    def prepare_completion(raw: bytes) -> "_CompletionPlan":
        """A completions request body -> its prompts (token ids, sampling params each), checked (blocking: runs
        in a worker thread).  Raises ``APIError``."""
        body = parse_json_body(raw)
        st.check_model(body)
        mt = body.get("max_tokens")
        generate = not (isinstance(mt, (int, float)) and not isinstance(mt, bool) and mt == 0)
        if not generate:  # checked as 1 below; nothing is generated
            body = dict(body, max_tokens=1)
        c = parse_common(body, vocab_size=engine.vocab_size, chat=False, max_n=engine.B)
        prompts = parse_prompts(body.get("prompt"))
        echo = opt_bool(body, "echo", False)
        prompt_k = parse_prompt_logprobs(body)
        grammar = request_grammar(body)
        if not generate and not echo and prompt_k is None:
            raise bad_request("max_tokens 0 generates nothing: it needs echo (or prompt_logprobs)", "max_tokens")
        if body.get("suffix") is not None:
            raise bad_request("suffix is not supported", "suffix", "unsupported")
        best_of = body.get("best_of")
        if best_of is not None and best_of != c.n:
            raise bad_request("best_of other than n is not supported", "best_of", "unsupported")
        skip_special = opt_bool(body, "skip_special_tokens", True)
        explicit = body.get("max_tokens") is not None
        plans = [(ids, st.fit_max_tokens(c, len(ids), explicit, "prompt")) for ids in prompts]
        echo_logprobs = echo and c.params.logprobs
        reports = None
        if echo or prompt_k is not None:
            scored = echo_logprobs or prompt_k is not None
            reports = [PromptReport(tokenizer, st.token_str, ids, skip_special,
                                    st.scorer.score(ids) if scored else None) for ids, _ in plans]
        echo_texts = [r.text for r in reports] if echo else ["" for _ in plans]
        guide_factory = None
        if grammar is not None:
            guide_factory = StructuredGuideBuilder(grammar, tokenizer, engine.vocab_size, fmt=None).build
        return _CompletionPlan(plans, c, echo_texts, skip_special, reports, echo_logprobs, prompt_k, generate,
                               guide_factory)

    def prompt_fields(plan: "_CompletionPlan", k: int) -> tuple[Optional[dict], dict]:
        """(the prompt's legacy logprobs or None, extra choice fields) for prompt ``k``."""
        if plan.reports is None:
            return None, {}
        rep = plan.reports[k]
        lp = rep.legacy_logprobs(plan.c.params.top_logprobs) if plan.echo_logprobs else None
        more = {"prompt_logprobs": rep.prompt_logprobs(plan.prompt_k)} if plan.prompt_k is not None else {}
        return lp, more

    def prompt_only_choices(plan: "_CompletionPlan") -> list[dict]:
        n, choices = plan.c.n, []
        for k in range(len(plan.prompts)):
            lp, more = prompt_fields(plan, k)
            for i in range(n):
                choices.append({"index": k * n + i, "text": plan.echo_texts[k], "logprobs": lp,
                                "finish_reason": "length", "stop_reason": None, **more})
        return choices

    def prompt_only_response(plan: "_CompletionPlan", rid: str, created: int) -> dict:
        n_prompt = sum(len(ids) for ids, _ in plan.prompts)
        return {"id": rid, "object": "text_completion", "created": created, "model": st.model_name,
                "choices": prompt_only_choices(plan), "usage": usage(n_prompt, 0, 0)}

    async def prompt_only_stream(plan: "_CompletionPlan", rid: str, created: int):
        base = {"id": rid, "object": "text_completion", "created": created, "model": st.model_name}
        extra = {"usage": None} if plan.c.include_usage else {}
        for ch in prompt_only_choices(plan):
            yield sse({**base, "choices": [ch], **extra})
        if plan.c.include_usage:
            yield sse({**base, "choices": [], "usage": usage(sum(len(ids) for ids, _ in plan.prompts), 0, 0)})
        yield "data: [DONE]\n\n"

    def parse_prompts(prompt) -> list[list[int]]:
        if isinstance(prompt, str):
            return [tokenizer.encode(prompt)]
        if isinstance(prompt, list) and prompt:
            if all(isinstance(p, str) for p in prompt):
                return [tokenizer.encode(p) for p in prompt]
            if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
                return [check_ids(prompt)]
            if all(isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
                   for p in prompt):
                return [check_ids(p) for p in prompt]
        raise bad_request("'prompt' must be a string, a list of strings, a list of token ids or a list of such lists "
                          "(non-empty)", "prompt", "invalid_type")

    def check_ids(ids):
        if min(ids) < 0 or max(ids) >= engine.vocab_size:
            raise bad_request(f"prompt token ids must lie in [0, {engine.vocab_size})", "prompt")
        return list(ids)

    def piece_text(pieces, skip_special):
        if skip_special:
            return "".join(p for p in pieces if isinstance(p, str))
        return "".join(p if isinstance(p, str) else (tokenizer.special_name(p) or "") for p in pieces)

    def legacy_logprobs(lps, offset0: int, texts: list[str]):
        offsets, pos = [], offset0
        for t in texts:
            offsets.append(pos)
            pos += len(t)
        return {"tokens": [st.token_str(x.token_id) for x in lps], "token_logprobs": [x.logprob for x in lps],
                "top_logprobs": [{st.token_str(t): lp for t, lp in x.top} for x in lps], "text_offset": offsets}

    async def merged(streams):
        q: asyncio.Queue = asyncio.Queue()

        async def pump(k, s):
            try:
                async for ev in s:
                    await q.put((k, ev))
            except BaseException as e:  # noqa: BLE001 -- handed to the consumer
                await q.put((k, e))

        tasks = [asyncio.create_task(pump(k, s)) for k, s in enumerate(streams)]
        left = len(streams)
        try:
            while left:
                k, ev = await q.get()
                if isinstance(ev, BaseException):
                    raise ev
                if isinstance(ev, RequestDone):
                    left -= 1
                yield k, ev
        finally:
            for t in tasks:
                t.cancel()

    async def completion_stream(streams, rids, rid, created, c, plan):
        echo_texts, skip_special = plan.echo_texts, plan.skip_special
        n = c.n
        dones: dict[int, RequestDone] = {}
        base = {"id": rid, "object": "text_completion", "created": created, "model": st.model_name}
        extra = {"usage": None} if c.include_usage else {}
        text_len: dict[int, int] = {}
        try:
            if plan.reports is not None:
                for k, t in enumerate(echo_texts):
                    lp, more = prompt_fields(plan, k)
                    for i in range(n):
                        text_len[k * n + i] = len(t)
                        yield sse({**base, "choices": [{"index": k * n + i, "text": t, "logprobs": lp,
                                                         "finish_reason": None, **more}], **extra})
            async for k, ev in merged(streams):
                if isinstance(ev, RequestDone):
                    dones[k] = ev
                    continue
                idx = k * n + ev.index
                text = piece_text(ev.pieces, skip_special)
                lp = None
                if ev.logprobs:
                    lp = legacy_logprobs(ev.logprobs, text_len.get(idx, 0), [text] + [""] * (len(ev.logprobs) - 1))
                text_len[idx] = text_len.get(idx, 0) + len(text)
                if text or lp or ev.finish_reason is None:
                    yield sse({**base, "choices": [{"index": idx, "text": text, "logprobs": lp,
                                                     "finish_reason": None}], **extra})
                if ev.finish_reason is not None:
                    yield sse({**base, "choices": [{"index": idx, "text": "", "logprobs": None,
                                                     "finish_reason": ev.finish_reason,
                                                     "stop_reason": ev.stop_reason}], **extra})
            if c.include_usage:
                yield sse({**base, "choices": [], "usage": usage(
                    sum(d.num_prompt_tokens for d in dones.values()), sum(d.num_generated_total for d in dones.values()),
                    sum(d.num_cached_tokens for d in dones.values()))})
            yield "data: [DONE]\n\n"
        except EngineError as e:
            yield sse_error(e)
        finally:
            st.drain.untrack(rid)
            if len(dones) < len(rids) and engine.alive:
                log.info("%s: client disconnected mid-stream; request aborted", rid)
            for k, r in enumerate(rids):
                if k not in dones:
                    engine.abort(r)

    async def completion_full(request, streams, rids, rid, created, c, plan):
        echo_texts, skip_special = plan.echo_texts, plan.skip_special
        n = c.n
        outs = {k * n + i: SequenceOutput(i) for k in range(len(streams)) for i in range(n)}
        texts: dict[int, list[str]] = {idx: [] for idx in outs}  # text of each generated token
        extra_text: dict[int, str] = {idx: "" for idx in outs}  # text flushed by a final event without a token
        dones: dict[int, RequestDone] = {}
        watcher = asyncio.create_task(st.watch_disconnect(request, rids, rid))
        try:
            async for k, ev in merged(streams):
                if isinstance(ev, RequestDone):
                    dones[k] = ev
                    continue
                idx = k * n + ev.index
                apply_event(outs[idx], ev)
                if ev.token_ids:
                    texts[idx].append(piece_text(ev.pieces, skip_special))
                else:
                    extra_text[idx] += piece_text(ev.pieces, skip_special)
        except EngineError as e:
            raise engine_api_error(e) from None
        finally:
            st.drain.untrack(rid)
            watcher.cancel()
            for k, r in enumerate(rids):
                if k not in dones:
                    engine.abort(r)
        choices = []
        for idx in sorted(outs):
            k = idx // n
            o = outs[idx]
            lp = None
            if c.params.logprobs:
                lp = legacy_logprobs(o.logprobs, len(echo_texts[k]), texts[idx])
            prompt_lp, more = prompt_fields(plan, k)
            choices.append({"index": idx, "text": echo_texts[k] + "".join(texts[idx]) + extra_text[idx],
                            "logprobs": merge_logprobs(prompt_lp, lp),
                            "finish_reason": o.finish_reason, "stop_reason": o.stop_reason, **more})
        return {"id": rid, "object": "text_completion", "created": created, "model": st.model_name,
                "choices": choices,
                "usage": usage(sum(d.num_prompt_tokens for d in dones.values()),
                               sum(d.num_generated_total for d in dones.values()),
                               sum(d.num_cached_tokens for d in dones.values()))}

    app.include_router(v1)
    return app
