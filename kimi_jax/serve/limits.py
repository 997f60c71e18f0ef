"""Limits on what one client can make the server do: request body size, JSON nesting, the engine queue.

* ``BodySizeLimit`` -- an ASGI middleware that answers 413 to a request body above ``max_bytes``: at once from its
  ``Content-Length``, or, for a body without one (chunked), as soon as the bytes received pass the limit -- never
  after buffering more than ``max_bytes``.
* ``QueueLimit`` -- admission control: at most ``max_queued`` requests waiting for the engine; beyond that a 429
  with ``Retry-After``.
"""

from __future__ import annotations

import json
from typing import Optional

from .errors import APIError, error_body

DEFAULT_MAX_REQUEST_BYTES = 32 * 1024 * 1024  # a 20 MB image as a data URL (base64: 27 MB) fits
DEFAULT_MAX_QUEUED_REQUESTS = 512
RETRY_AFTER_S = 1


class BodySizeLimit:
    """ASGI middleware: HTTP request bodies larger than ``max_bytes`` get a 413 (OpenAI error body) before the app
    sees them.  A body within the limit is read here and replayed to the app, so it is held once, never beyond the
    limit."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = int(max_bytes)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            return await self._too_large(send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending the whole body
                return await self.app(scope, _replay([], message, receive), send)
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                return await self._too_large(send)
            chunks.append(body)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(chunks, None, receive), send)

    async def _too_large(self, send) -> None:
        body = json.dumps(error_body(f"the request body is larger than this server's limit of {self.max_bytes} "
                                     "bytes (--max-request-bytes)", "invalid_request_error", None,
                                     "request_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def _content_length(scope) -> Optional[int]:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _replay(chunks: list, final: Optional[dict], receive):
    """A ``receive`` that hands the app the body read already as one message, then defers to the real one (which
    reports the client's disconnect)."""
    pending = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}] if final is None else [final]

    async def replay():
        if pending:
            return pending.pop()
        return await receive()

    return replay


class QueueLimit:
    """Admission control over the engine's queue: ``check()`` raises a 429 (with ``Retry-After``) while
    ``max_queued`` or more requests wait for a slot.  ``None``: no limit.  Called on the event loop right before
    ``engine.submit`` (and once early, before the request is prepared), so check and submit cannot interleave with
    another request's."""

    def __init__(self, engine, max_queued: Optional[int]):
        self.engine = engine
        self.max_queued = max_queued

    def check(self) -> None:
        if self.max_queued is None:
            return
        if self.engine.queued_requests() >= self.max_queued:
            raise APIError(429, f"the server is busy: {self.max_queued} requests are already waiting "
                                "(--max-queued-requests); retry later", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
