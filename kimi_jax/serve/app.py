"""The OpenAI-compatible HTTP API (FastAPI) over an ``Engine``: ``build_app`` puts the app's ``ServerState``
(``state.py``) on ``app.state.kimi`` and includes the module-level routers, which reach it through
``Depends(get_state)``.

Endpoints (router module in brackets)
  POST /v1/chat/completions   [routes_chat] chat (stream or not); reasoning as ``reasoning_content`` (alias
                              ``reasoning``); tool calls parsed into ``tool_calls`` (streamed as deltas);
                              ``tool_choice`` none / auto / required / a named function (the last two guided, K3
                              format; with no tools or "none" a call the model writes anyway is content, never
                              ``tool_calls``); n, logprobs, top_logprobs, seed, stop, logit_bias, penalties;
                              ``stream_options.include_usage``
  POST /v1/completions        [routes_completions] text completion: prompt as a string, a list of strings, token
                              ids or lists of ids; echo, prompt_logprobs
  GET  /v1/models             [routes_health] the served model
  POST /tokenize, /detokenize [routes_tokenizer] vLLM-style helpers (a prompt string or chat messages -> ids;
                              ids -> text)
  GET  /tokenizer_info        [routes_tokenizer] vLLM's shape, for lm-eval's remote tokenizer
  GET  /health                [routes_health] 200 while the engine runs, 503 once it died
  GET  /metrics, /stats       [routes_health] Prometheus text (``metrics.py``); the engine's counters as JSON
  GET  /version               [routes_health] the package version

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

import logging
import time
from typing import Optional

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.prompt_logprobs import PromptScorer
from . import profiling, routes_chat, routes_completions, routes_health, routes_tokenizer
from .errors import INTERNAL_ERROR, APIError, error_body
from .formats import ChatFormat, chat_format_for
from .images import ImageFetchConfig
from .lifecycle import Drain
from .limits import DEFAULT_MAX_QUEUED_REQUESTS, DEFAULT_MAX_REQUEST_BYTES, BodySizeLimit, QueueLimit
from .metrics import ServerMetrics
from .state import ServerState, require_key

log = logging.getLogger("kimi_jax.serve")


def build_app(engine, tokenizer, *, model_name: str, api_key: Optional[str] = None,
              chat_format: Optional[ChatFormat] = None, guided_string_max_tokens: int = 256,
              image_fetch: Optional[ImageFetchConfig] = None,
              max_request_bytes: Optional[int] = DEFAULT_MAX_REQUEST_BYTES,
              max_queued_requests: Optional[int] = DEFAULT_MAX_QUEUED_REQUESTS,
              drain: Optional[Drain] = None, profile_dir: Optional[str] = None) -> FastAPI:
    """The FastAPI app for a started engine.  ``guided_string_max_tokens`` caps a string argument of a forced tool
    call (``tool_choice`` required / named) in case the model never closes it.  ``image_fetch``: limits on image
    parts (fetch timeout, sizes, whether http(s) URLs are fetched at all, private destinations).
    ``max_request_bytes``: larger bodies get a 413 (None: no limit).  ``max_queued_requests``: requests waiting for
    the engine beyond which new ones get a 429 (None: no limit).  ``drain``: the shutdown state the server's signal
    handler drives (``lifecycle.DrainingServer``); default a fresh one that never drains.  ``profile_dir``: where
    ``POST /start_profile`` / ``/stop_profile`` write device traces (``profiling.py``); None: no such endpoints."""
    fmt = chat_format if chat_format is not None else chat_format_for(engine.model.config.architecture, tokenizer)
    drain = drain if drain is not None else Drain()
    st = ServerState(engine=engine, tokenizer=tokenizer, model_name=model_name, chat_format=fmt,
                     api_key=api_key or None, metrics=ServerMetrics(engine, model_name), created=int(time.time()),
                     image_fetch=image_fetch or ImageFetchConfig(), guided_string_max_tokens=guided_string_max_tokens,
                     drain=drain, queue_limit=QueueLimit(engine, max_queued_requests),
                     # prompt log-probs (a program per length bucket; on every process of a multi-process server)
                     scorer=PromptScorer(engine.model, engine.max_model_len, engine.mirror))
    docs_open = st.api_key is None  # with a key, the schema and its pages are behind it too (`_docs`)
    app = FastAPI(title="kimi_jax", description="OpenAI-compatible server for kimi_jax models", version="0.1.0",
                  docs_url="/docs" if docs_open else None, redoc_url="/redoc" if docs_open else None,
                  openapi_url="/openapi.json" if docs_open else None)
    if max_request_bytes is not None:
        app.add_middleware(BodySizeLimit, max_bytes=max_request_bytes)
    app.state.kimi = st
    app.state.drain = drain
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    if not docs_open:
        app.include_router(_docs)
    for router in (routes_health.router, routes_health.models_router, routes_tokenizer.router, routes_chat.router,
                   routes_completions.router):
        app.include_router(router)
    if profile_dir is not None:
        app.include_router(profiling.router(profiling.Profiler(profile_dir)))
    return app


# ------------------------------------------------------------------------------------------------ errors
async def _api_error(req: Request, e: APIError):
    """An ``APIError`` as its JSON body, status and headers."""
    # the access log shows only the status; say why (a client's 4xx at info, a 5xx as a warning)
    log.log(logging.WARNING if e.status >= 500 else logging.INFO, "%s %s -> %d %s: %s", req.method,
            req.url.path, e.status, e.code or e.type, e.message)
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _http_error(req: Request, e: StarletteHTTPException):
    """Starlette's own HTTP errors (unknown route, wrong method, ...) in the OpenAI error shape."""
    code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
    msg = str(e.detail)
    if e.status_code == 405 and e.headers and e.headers.get("Allow"):
        msg = f"{req.method} is not allowed on {req.url.path}; use {e.headers['Allow']}"
    return JSONResponse(error_body(msg, "invalid_request_error", None, code), status_code=e.status_code,
                        headers=e.headers)  # a 405 keeps its Allow header


async def _internal_error(req: Request, e: Exception):
    """Anything else: a 500 that says only "internal server error"; the exception goes to the log."""
    log.error("%s %s -> 500: internal error", req.method, req.url.path, exc_info=e)
    return JSONResponse(error_body(INTERNAL_ERROR, "server_error", None, None), status_code=500)


# ------------------------------------------------------------------------------------------------ docs
# /openapi.json, /docs and /redoc behind the API key, where the app has one (an open app has FastAPI's own).  The
# browser pages fetch the schema without the key; send it yourself (e.g. curl /openapi.json with the header).
_docs = APIRouter(dependencies=[Depends(require_key)])


@_docs.get("/openapi.json", include_in_schema=False)
async def openapi(request: Request):
    return JSONResponse(request.app.openapi())


@_docs.get("/docs", include_in_schema=False)
async def docs(request: Request):
    return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{request.app.title} - docs")


@_docs.get("/redoc", include_in_schema=False)
async def redoc(request: Request):
    return get_redoc_html(openapi_url="/openapi.json", title=f"{request.app.title} - ReDoc")
