"""The target platform of a trace: what "auto" backends resolve against.

By default that is the platform of `jax.default_backend()` at trace time. Exporting for another platform (e.g.
`jax.export` for TPU from a CPU host) passes it explicitly, so "auto" picks the kernel of the platform the program
will run on. Resolution never probes a device: it only reads the name and, for GPU, whether the kernel's Pallas
lowering imports.
"""

from __future__ import annotations

from typing import Optional

import jax

PLATFORMS = ("cpu", "tpu", "gpu", "cuda", "rocm")
_CANONICAL = {"cuda": "gpu", "rocm": "gpu"}


def resolve_platform(platform: Optional[str] = None) -> str:
    """"cpu" | "tpu" | "gpu" for a platform name ("cuda" / "rocm" are "gpu"); None = `jax.default_backend()`."""
    name = jax.default_backend() if platform is None else str(platform).lower()
    if name not in PLATFORMS:
        if platform is None:  # an unknown host backend (e.g. a plugin): no kernel of ours, the reference path
            return "cpu"
        raise ValueError(f"unknown platform {platform!r}; choose one of {PLATFORMS} or None")
    return _CANONICAL.get(name, name)
