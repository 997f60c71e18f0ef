"""Graceful shutdown: on SIGTERM / Ctrl-C stop accepting, let running requests finish up to a deadline, then end
the ones still running with an error (a stream gets an error chunk and ``data: [DONE]``); a second signal stops at
once.

``Drain`` is the app's side: it knows the requests in flight (``track`` / ``untrack``), refuses new ones once
draining, and at the deadline (``expire``) aborts the engine requests and hands each waiting consumer a
``ShuttingDownError`` through its ``RequestStream``.  ``DrainingServer`` is uvicorn's side: its signal handler
starts the drain and arms the deadline on the event loop; uvicorn itself stops listening and waits for the
connections to close (its own ``timeout_graceful_shutdown`` is set a little past the deadline, as a backstop).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Callable, Optional

import uvicorn

from ..engine import EngineError

log = logging.getLogger("kimi_jax.serve")

DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
BACKSTOP_S = 5.0  # uvicorn cancels what is still running this long after our deadline


class ShuttingDownError(EngineError):
    """The server is shutting down and this request was still running at the ``--shutdown-timeout`` deadline."""


class Drain:
    """The requests in flight, and whether the server is draining them (no new ones taken)."""

    def __init__(self):
        self.draining = False
        self._active: dict[str, tuple[list, list[str]]] = {}  # key -> (its RequestStreams, their engine ids)

    def track(self, key: str, streams: list, engine_ids: list[str]) -> None:
        self._active[key] = (streams, engine_ids)

    def untrack(self, key: str) -> None:
        self._active.pop(key, None)

    @property
    def in_flight(self) -> int:
        return len(self._active)

    def begin(self) -> None:
        self.draining = True
        log.info("shutting down: no new requests; %d in flight may finish", self.in_flight)

    def expire(self, abort: Callable[[str], None]) -> None:
        """The deadline: abort every request still in flight (``abort(engine_id)``) and wake its consumer with a
        ``ShuttingDownError``."""
        if self._active:
            log.warning("shutdown deadline: ending %d request(s) still running", len(self._active))
        err = ShuttingDownError("the server is shutting down; this request was stopped before it finished")
        for streams, engine_ids in list(self._active.values()):
            for rid in engine_ids:
                abort(rid)
            for stream in streams:
                stream.put(err)
        self._active.clear()


class DrainingServer(uvicorn.Server):
    """uvicorn's server with our shutdown: the first SIGINT / SIGTERM starts ``drain`` and arms its deadline
    ``timeout_s`` later (``expire(abort)``); a second signal of either kind exits at once."""

    def __init__(self, config: uvicorn.Config, drain: Drain, timeout_s: float, abort: Callable[[str], None]):
        super().__init__(config)
        self.drain = drain
        self.timeout_s = timeout_s
        self.abort = abort
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if self.should_exit:  # a second signal: stop now (uvicorn's own rule covers only a second SIGINT)
            log.warning("second %s: stopping at once", signal.Signals(sig).name)
            self.force_exit = True
            return
        super().handle_exit(sig, frame)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._begin_drain)

    def _begin_drain(self) -> None:
        self.drain.begin()
        self._loop.call_later(self.timeout_s, self.drain.expire, self.abort)


def run_server(app, *, host: str, port: int, log_level: str, shutdown_timeout_s: float, drain: Drain,
               abort: Callable[[str], None]) -> None:
    """``uvicorn.run`` with the graceful shutdown above (blocking; returns once the server has stopped)."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=shutdown_timeout_s + BACKSTOP_S)
    DrainingServer(config, drain, shutdown_timeout_s, abort).run()
