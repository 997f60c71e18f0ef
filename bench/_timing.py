"""The timer the JAX benches share (imported as `from _timing import ...`: the bench scripts run as files, so their
own folder is first on sys.path)."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp


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


def chained(fn, n: int, stacked=()):
    """`fn` called n times in ONE jitted program, each call's inputs passed through an optimization barrier together
    with the previous call's outputs (so XLA can neither merge the calls nor reorder them) -> (the last outputs, the
    sum of every call's outputs: the one use that keeps each call alive; it adds one read of the outputs per call).
    Arguments at the positions in `stacked` carry a leading axis of n: call i gets slice i, so each call can read
    different memory (a chain over the same few MB would be served from the 50 MB L2, not HBM).
    Timing it and dividing by n measures the device time of a short op as it runs inside a model step, without the
    ≈ 50 µs per-call host dispatch that bounds back-to-back dispatch of a microsecond-scale jit."""

    def many(*args):
        out, live = None, jnp.float32(0)
        for i in range(n):
            out = fn(*(a[i] if p in stacked else a for p, a in enumerate(args)))
            # every call's outputs feed the result (a sum per leaf), or jax would drop all calls but the last
            live = live + sum(jnp.sum(x.astype(jnp.float32)) for x in jax.tree_util.tree_leaves(out))
            args, _ = jax.lax.optimization_barrier((args, out))
        return out, live

    return jax.jit(many)


def device_seconds(fn, *args, stacked=(), budget_s: float = 0.25, min_reps: int = 3) -> tuple[float, int]:
    """(seconds per call, calls per program). With `stacked` (positions of arguments with a leading axis of n
    distinct inputs): `chained(fn, n, stacked)`, timed by `pipelined_seconds` and divided by n. Without: plain
    `pipelined_seconds` of `fn` (n = 1)."""
    n = 1
    if stacked:
        n = args[stacked[0]].shape[0]
        fn = chained(fn, n, stacked)
    jax.block_until_ready(fn(*args))
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    est = max(time.perf_counter() - t, 1e-6)
    reps = int(max(min_reps, min(200, budget_s / est)))
    return pipelined_seconds(fn, *args, reps=reps) / n, n


def torch_copy_bandwidth(nbytes: int = 1 << 31, reps: int = 20) -> float:
    """Bytes read + written per second of a plain device copy of `nbytes` (torch `copy_`, CUDA events, median of
    `reps`): the ≈ 4.2–4.3 TB/s H200 anchor of BENCHMARKS.md that the GPU benches divide by. Needs torch with CUDA."""
    import torch

    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) / 1e3)
    del a, b
    torch.cuda.empty_cache()  # torch's allocator would keep the 2 x nbytes buffers from the JAX benches after it
    return 2 * nbytes / statistics.median(ts)


def torch_event_seconds(fn, *, calls: int = 10, rounds: int = 5) -> float:
    """Median seconds per call of `fn(i)`, i = 0 .. calls-1 run back to back between two CUDA events, over `rounds`
    rounds after one untimed pass (compiles, allocations). `i` lets a caller cycle through different inputs (rows
    that are not in L2 yet). Needs torch with CUDA."""
    import torch

    for i in range(calls):
        fn(i)
    torch.cuda.synchronize()
    ts = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(calls):
            fn(i)
        end.record()
        end.synchronize()
        ts.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(ts)


def torch_kernel_seconds(fn, *args, reps: int = 10) -> dict:
    """{GPU kernel name: device seconds per call} for the kernels `fn(*args)` launches, XLA's included: torch's
    profiler (CUPTI) records every kernel of the process. Beside a wall-clock time it tells a kernel's own time from
    the launch overhead around it (e.g. a custom call that breaks XLA's command buffers). Needs torch with CUDA."""
    from torch.profiler import ProfilerActivity, profile

    jax.block_until_ready(fn(*args))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            jax.block_until_ready(fn(*args))
    out = {}
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", None)
        us = ev.cuda_time_total if us is None else us
        if us:
            out[ev.key] = us / reps / 1e6
    return out
