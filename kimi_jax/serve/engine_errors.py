"""The answer to a request the engine cannot take or finish: an ``EngineError`` as an OpenAI-shaped 503."""

from __future__ import annotations

from ..engine import EngineError, EngineUnavailableError, RequestFailedError
from .errors import APIError
from .lifecycle import ShuttingDownError
from .limits import RETRY_AFTER_S

_RETRY = {"Retry-After": str(RETRY_AFTER_S)}


def engine_api_error(e: EngineError) -> APIError:
    """The answer to a request the engine could not finish: always a 503 with a fixed text per cause (the
    exception's own text, which may carry internals, goes to the log only)."""
    if isinstance(e, ShuttingDownError):
        return APIError(503, "the server is shutting down; the request was stopped before it finished",
                        code="server_shutting_down")
    if isinstance(e, RequestFailedError):
        return APIError(503, "the engine failed while running this request; it is recovering, retry shortly",
                        code="engine_error", headers=_RETRY)
    if isinstance(e, EngineUnavailableError):
        return APIError(503, "the engine is recovering from a failure; retry shortly", code="engine_unavailable",
                        headers=_RETRY)
    return APIError(503, "the engine is not running", code="engine_dead")
