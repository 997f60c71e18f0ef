"""Readers of the Mosaic GPU sparse MLA kernel's per-phase timer stamps (`sparse_mgpu.kernel_call(trace=True)`):
where a CTA's time goes. Used by `bench/mla_mgpu.py --ops trace` and its test.
"""

from __future__ import annotations

import numpy as np


def trace_ns(trace) -> np.ndarray:
    """`kernel_call(trace=True)`'s stamps `[..., T]` int32 (the timer's low 32 bits) -> int64 ns with each row's
    32-bit wrap undone (a row spans microseconds; the timer wraps every 4.3 s)."""
    t = np.asarray(trace, np.int64)
    return (t - t[..., :1]) % (1 << 32) + t[..., :1]


def trace_phases(trace, blocks_per_wg: int) -> dict:
    """`kernel_call(trace=True)`'s stamps `[NS, B, NW, T]` int32 (ns, low 32 bits) -> each phase's duration in µs
    over every CTA warpgroup (median, max) and the kernel's span: "launch skew" (this CTA's start after the first
    CTA's), "slots + translate", "q ready / prepared", per block "wait gather" and "compute", "finish + combine",
    "last merge". Positions: 0 start, 1 slots translated, 2 q ready, 3 + 2i gather i arrived, 4 + 2i block i
    computed, 3 + 2n finished (combined), 4 + 2n merged."""
    t = trace_ns(trace)
    t0 = t[..., 0]
    us = lambda a: np.asarray(a, np.float64) / 1e3  # noqa: E731
    phases = {"launch skew": us(t0 - t0.min()), "slots + translate": us(t[..., 1] - t[..., 0]),
              "q ready / prepared": us(t[..., 2] - t[..., 1])}
    prev = t[..., 2]
    for i in range(blocks_per_wg):
        phases[f"block {i} wait gather"] = us(t[..., 3 + 2 * i] - prev)
        phases[f"block {i} compute"] = us(t[..., 4 + 2 * i] - t[..., 3 + 2 * i])
        prev = t[..., 4 + 2 * i]
    n = blocks_per_wg
    phases["finish + combine"] = us(t[..., 3 + 2 * n] - prev)
    phases["last merge"] = us(t[..., 4 + 2 * n] - t[..., 3 + 2 * n])
    phases["CTA total"] = us(t[..., 4 + 2 * n] - t[..., 0])
    phases["kernel span"] = us(np.array([t[..., 4 + 2 * n].max() - t0.min()]))
    return {k: (float(np.median(v)), float(v.max())) for k, v in phases.items()}
