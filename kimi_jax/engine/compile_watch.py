"""Counts XLA backend compilations in this process (``jax.monitoring``'s backend-compile event).

The engine reports the count in its stats and on /metrics (``kimi_jax:xla_compilations_total``): after start-up it
must stay constant however many requests of whatever lengths are served.
"""

from __future__ import annotations

import threading

import jax

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"

_lock = threading.Lock()
_count = 0
_seconds = 0.0
_installed = False


def _listener(event: str, duration: float, **_kw) -> None:
    global _count, _seconds
    if event == BACKEND_COMPILE_EVENT:
        with _lock:
            _count += 1
            _seconds += float(duration)


def install() -> None:
    """Register the listener (once per process)."""
    global _installed
    with _lock:
        if _installed:
            return
        jax.monitoring.register_event_duration_secs_listener(_listener)
        _installed = True


def compile_count() -> int:
    install()
    return _count


def compile_seconds() -> float:
    install()
    return _seconds
