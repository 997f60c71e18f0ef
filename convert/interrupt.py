"""Interrupts that cannot be lost.

The command line turns Ctrl-C and SIGTERM into an exception raised wherever Python happens to be. When that is
inside a callback whose exceptions Python ignores (JAX's garbage-collection hook, a `__del__`), the exception
is printed as "Exception ignored" and the conversion would run on to the end. So the CLI's handlers also record
the interrupt here, and the conversion loops (one check per tensor) and the final commit of the output directory
(`store.atomic_directory`) raise it again. Without the CLI nothing is ever recorded and `check` does nothing.
Inside `deferred()` the handlers only record: steps that must not be cut in two run there, and a `check` after
them raises what came meanwhile.
"""

from __future__ import annotations

import contextlib

_pending: type[BaseException] | None = None
_deferring = 0  # > 0 inside `deferred()`: the CLI's handlers record an interrupt but do not raise it


def request(exc_type: type[BaseException]) -> None:
    """Record an interrupt (from a signal handler) for the next `check`."""
    global _pending
    _pending = exc_type


def clear() -> None:
    global _pending
    _pending = None


def check() -> None:
    """Raise the recorded interrupt, if any (once)."""
    global _pending
    if _pending is not None:
        exc, _pending = _pending, None
        raise exc()


def deferring() -> bool:
    """Whether a signal handler should only record its interrupt (inside `deferred()`), not raise it."""
    return _deferring > 0


@contextlib.contextmanager
def deferred():
    """A few steps that must not be cut in two by an interrupt (a temporary directory and its owner file: one
    without the other is a directory nobody removes). An interrupt that comes meanwhile is only recorded; the
    caller's next `check` raises it."""
    global _deferring
    _deferring += 1
    try:
        yield
    finally:
        _deferring -= 1
