"""One app's server state, the checks every generation request goes through, and the dependencies routes reach
them by.

``build_app`` puts one ``ServerState`` on ``app.state.kimi``; a route takes it as ``st: ServerState =
Depends(get_state)``, and the routers that need the API key carry ``Depends(require_key)``.  Several apps may
serve one engine in one process, each with its own state.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from dataclasses import dataclass
from typing import Any, Optional

from fastapi import Request

from ..engine import EngineDeadError, EngineError, EngineUnavailableError, ParamError
from .engine_errors import engine_api_error
from .errors import APIError, bad_request
from .formats import ChatFormat
from .images import ImageFetchConfig
from .lifecycle import Drain
from .limits import QueueLimit
from .metrics import ServerMetrics

log = logging.getLogger("kimi_jax.serve")


@dataclass(kw_only=True)
class ServerState:
    """What the routes of one app share: the engine and tokenizer, the served name and chat format (None: the
    model has none), the API key (None: open), and the app's metrics, drain, queue limit and prompt scorer
    (``engine.prompt_logprobs.PromptScorer``).  ``created``: the model card's timestamp."""

    engine: Any
    tokenizer: Any
    model_name: str
    chat_format: Optional[ChatFormat]
    api_key: Optional[str]
    metrics: ServerMetrics
    created: int
    image_fetch: ImageFetchConfig
    guided_string_max_tokens: int
    drain: Drain
    queue_limit: QueueLimit
    scorer: Any

    def check_model(self, body: dict) -> None:
        """A 400 / 404 unless the body's ``model`` is absent or names the served model."""
        m = body.get("model")
        if m is not None and not isinstance(m, str):
            raise bad_request(f"'model' must be a string, got {json.dumps(m)[:80]}", "model", "invalid_type")
        if m is not None and m != self.model_name:
            raise APIError(404, f"The model `{m}` does not exist. This server serves `{self.model_name}`.",
                           param="model", code="model_not_found")

    def unready_error(self) -> Optional[APIError]:
        """Why the engine cannot take a request now (shutting down, dead, recovering), or None while it can."""
        if self.drain.draining:
            return APIError(503, "the server is shutting down", code="server_shutting_down")
        if not self.engine.alive:
            return engine_api_error(EngineDeadError())
        if not self.engine.healthy:
            return engine_api_error(EngineUnavailableError())
        return None

    def check_ready(self) -> None:
        """Refuse a generation request the engine cannot take now: shutting down, dead, recovering, queue full."""
        err = self.unready_error()
        if err is not None:
            raise err
        self.queue_limit.check()

    def fit_max_tokens(self, c, prompt_len: int, explicit: bool, what: str):
        """``c.params`` (``protocol.Common``) with ``max_tokens`` fitted to the context left after a ``prompt_len``
        token ``what`` (named in the errors): a 400 when the prompt fills the context, an ``explicit`` max_tokens
        does not fit, or ``min_tokens`` exceeds the result."""
        L = self.engine.max_model_len
        if prompt_len >= L:
            raise bad_request(f"This model's maximum context length is {L} tokens. However, your {what} resulted in "
                              f"{prompt_len} tokens. Please reduce the length of the {what}.", what,
                              "context_length_exceeded")
        room = L - prompt_len
        mt = c.max_tokens if (explicit and c.max_tokens is not None) else None
        if mt is not None and mt > room:
            raise bad_request(f"This model's maximum context length is {L} tokens. However, you requested "
                              f"{prompt_len + mt} tokens ({prompt_len} in the {what}, {mt} in the completion). "
                              f"Please reduce the length of the {what} or completion.", c.max_tokens_param,
                              "context_length_exceeded")
        if mt is None:
            mt = min(c.max_tokens, room) if c.max_tokens is not None else room
        if c.params.min_tokens > mt:
            raise bad_request(f"min_tokens ({c.params.min_tokens}) exceeds max_tokens ({mt})", "min_tokens")
        return c.params.replace(max_tokens=mt)

    def submit(self, ids, params, n, rid, guide_factory=None, images=None):
        """``engine.submit`` on the event loop, after ``check_ready`` (nothing awaits between the two, so the queue
        limit holds against a burst)."""
        self.check_ready()
        try:
            return self.engine.submit(ids, params, n=n, request_id=rid, guide_factory=guide_factory,
                                      loop=asyncio.get_running_loop(), images=images)
        except ParamError as e:
            raise bad_request(str(e), e.param) from None
        except EngineError as e:
            raise engine_api_error(e) from None

    async def watch_disconnect(self, request: Request, rids: list[str], label: str) -> None:
        """Abort the engine requests ``rids`` once the client of ``request`` disconnects; run as a task that the
        route cancels when the answer is complete."""
        try:
            while True:
                await asyncio.sleep(0.25)
                if await request.is_disconnected():
                    log.info("%s: client disconnected; request aborted", label)
                    for rid in rids:
                        self.engine.abort(rid)
                    return
        except asyncio.CancelledError:
            pass

    def token_str(self, tid: int) -> str:
        """A token as the logprobs fields name it: a control token's name, else its bytes as UTF-8 (replaced)."""
        name = self.tokenizer.special_name(tid)
        return name if name is not None else self.tokenizer.token_bytes(tid).decode("utf-8", errors="replace")

    def token_bytes(self, tid: int) -> list[int]:
        return list(self.tokenizer.token_bytes(tid))


async def get_state(request: Request) -> ServerState:
    """The dependency that hands a route its app's ``ServerState``."""
    return request.app.state.kimi


async def require_key(request: Request) -> None:
    """The dependency that refuses (401) a request without the app's bearer key, where the app has one."""
    key = request.app.state.kimi.api_key
    if key is None:
        return
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(401, "Incorrect or missing API key. Send 'Authorization: Bearer <key>'.",
                       code="invalid_api_key")
