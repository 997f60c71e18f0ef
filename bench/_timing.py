"""The timer the JAX benches share (imported as `from _timing import ...`: the bench scripts run as files, so their
own folder is first on sys.path)."""

from __future__ import annotations

import statistics
import time

import jax


def pipelined_seconds(fn, *args, reps: int, rounds: int = 3) -> float:
    """Seconds per call of `fn(*args)`: `reps` back-to-back dispatches and one sync (host dispatch overlaps device
    work, as it does in a serving loop), median over `rounds` such rounds. Compile / warm up before calling."""
    ts = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(reps):
            r = fn(*args)
        jax.block_until_ready(r)
        ts.append((time.perf_counter() - t) / reps)
    return statistics.median(ts)
