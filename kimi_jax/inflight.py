"""A bound on the programs a loop dispatches ahead of their results, on JAX's CPU backend.

XLA's CPU client admits at most 32 computations in flight per device. A multi-device program's partitions are
launched from a shared worker pool, and a worker launching a partition waits there for its device's admission.
With a collective in the program, the partitions already running wait for the ones still waiting to be admitted;
once every worker waits, nothing runs again. A loop that dispatches programs faster than the CPU runs them (the
engine's prefill chunks and decode steps on 8 faked devices on a loaded 2-core host; a chain of ~2,000 small
programs with an all-gather hung 3 runs of 3) reaches that state. Waiting for one result every `CPU_SYNC_EVERY`
programs keeps every device below the limit. Only the CPU backend is bounded: the deadlock is its client's, and on
an accelerator a wait would leave the device idle between two programs.
"""

from __future__ import annotations

from typing import Optional

import jax

from sharding.mesh import mesh_platform

CPU_SYNC_EVERY = 16  # programs between two waits; the chain above ran at 8, 16 and 24, hung without


class InflightBound:
    """Call it on each dispatched program's output: on CPU every `CPU_SYNC_EVERY`-th output is waited for (the
    same object is returned); elsewhere it only returns it."""

    def __init__(self, platform: Optional[str] = None, every: int = CPU_SYNC_EVERY):
        platform = platform or jax.default_backend()
        self.every = int(every) if platform == "cpu" else 0
        self._dispatched = 0

    @classmethod
    def for_mesh(cls, mesh) -> "InflightBound":
        """The bound for programs over `mesh` (None: the default backend's devices)."""
        return cls(mesh_platform(mesh))

    def __call__(self, out):
        if self.every:
            self._dispatched += 1
            if self._dispatched >= self.every:
                jax.block_until_ready(out)
                self._dispatched = 0
        return out
