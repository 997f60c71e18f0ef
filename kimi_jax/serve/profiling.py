"""On-demand device traces of a running server: ``POST /start_profile`` and ``POST /stop_profile`` (vLLM's
endpoints), enabled by ``--profile-dir DIR`` and behind the API key.

Between the two calls ``jax.profiler`` records what this process runs (host threads, XLA programs, each kernel on
the GPU or TPU) into a new directory under DIR; ``/stop_profile`` answers with that directory. It holds the
TensorBoard profile (``plugins/profile/<run>/*.xplane.pb``) and a Perfetto trace (``*.trace.json.gz``, open it at
ui.perfetto.dev or summarise it with ``bench/trace_summary.py``). A multi-process server traces process 0 only.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Optional

from fastapi import APIRouter, Depends

from .errors import APIError
from .state import require_key

log = logging.getLogger("kimi_jax.serve")


class Profiler:
    """One trace at a time into a fresh ``<root>/<UTC time>-<n>`` directory. Thread-safe."""

    def __init__(self, root: str):
        """``root``: the directory traces go under (created at the first trace)."""
        self.root = os.path.abspath(root)
        self._lock = threading.Lock()
        self._dir: Optional[str] = None
        self._started = 0.0
        self._count = 0

    def start(self) -> str:
        """Start tracing; returns the trace's directory. ``RuntimeError`` if a trace is running already."""
        import jax

        with self._lock:
            if self._dir is not None:
                raise RuntimeError(f"a trace is running already (into {self._dir}); stop it first")
            self._count += 1
            path = os.path.join(self.root, time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + f"-{self._count}")
            os.makedirs(path, exist_ok=True)
            jax.profiler.start_trace(path, create_perfetto_trace=True)
            self._dir, self._started = path, time.monotonic()
        log.info("profiling: trace started into %s", path)
        return path

    def stop(self) -> tuple[str, float]:
        """Stop the running trace and write it; returns (its directory, seconds traced). ``RuntimeError`` if none
        is running."""
        import jax

        with self._lock:
            if self._dir is None:
                raise RuntimeError("no trace is running; POST /start_profile first")
            path, seconds = self._dir, time.monotonic() - self._started
            try:
                jax.profiler.stop_trace()
            finally:
                self._dir = None
        log.info("profiling: %.1f s traced into %s", seconds, path)
        return path, seconds


def router(profiler: Profiler) -> APIRouter:
    """The two endpoints over ``profiler`` (behind the API key, like generation)."""
    r = APIRouter(dependencies=[Depends(require_key)])

    @r.post("/start_profile")
    def start_profile():  # a plain def: FastAPI runs it in its thread pool, off the event loop
        try:
            path = profiler.start()
        except RuntimeError as e:
            raise APIError(409, str(e), code="profile_running") from None
        return {"status": "tracing", "trace_dir": path}

    @r.post("/stop_profile")
    def stop_profile():
        try:
            path, seconds = profiler.stop()
        except RuntimeError as e:
            raise APIError(409, str(e), code="profile_not_running") from None
        return {"status": "stopped", "trace_dir": path, "seconds": round(seconds, 3)}

    return r
