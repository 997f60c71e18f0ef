"""Device meshes from the CLI's `--mesh` forms.

`AxB` means A-way model parallelism × B-way data parallelism over A·B devices. The mesh axes are named
("data", "model"): parameters split over "model" (KDA/MLA heads, experts, vocab), batches over "data".
The named form `model=4,data=2` is accepted too. Multi-host: call `jax.distributed.initialize()` first
(`initialize_distributed()` does it when the standard environment variables are present).
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.sharding import Mesh

AXES = ("data", "model")


class MeshError(ValueError):
    """A mesh that cannot be built on the devices at hand."""


def parse_mesh_spec(text: str) -> dict[str, int]:
    """'8x1' -> {'model': 8, 'data': 1}; 'model=4,data=2' -> the same form."""
    text = text.strip().lower()
    try:
        if "=" in text:
            sizes = {k.strip(): int(v) for k, v in (p.split("=") for p in text.split(","))}
            unknown = set(sizes) - set(AXES)
            if unknown:
                raise MeshError(f"unknown mesh axes {sorted(unknown)}; known axes: {', '.join(AXES)}")
        else:
            a, b = text.split("x")
            sizes = {"model": int(a), "data": int(b)}
    except MeshError:
        raise
    except Exception:  # noqa: BLE001
        raise MeshError(f"--mesh must look like AxB (model x data) or model=A,data=B; got {text!r}") from None
    if any(v < 1 for v in sizes.values()):
        raise MeshError(f"mesh axis sizes must be positive, got {sizes}")
    return {axis: sizes.get(axis, 1) for axis in AXES}


def make_mesh(spec: str | dict, devices=None) -> Mesh:
    """A `jax.sharding.Mesh` with axes ("data", "model") over the first data·model devices."""
    sizes = parse_mesh_spec(spec) if isinstance(spec, str) else {a: spec.get(a, 1) for a in AXES}
    devices = list(jax.devices()) if devices is None else list(devices)
    need = sizes["data"] * sizes["model"]
    if need > len(devices):
        hint = ""
        if devices and devices[0].platform == "cpu":
            hint = (f" On CPU, fake {need} devices with XLA_FLAGS=--xla_force_host_platform_device_count={need} "
                    "(set it before Python starts).")
        raise MeshError(f"mesh {sizes['model']}x{sizes['data']} needs {need} devices but only {len(devices)} "
                        f"{devices[0].platform if devices else ''} device(s) exist.{hint}")
    grid = np.array(devices[:need]).reshape(sizes["data"], sizes["model"])
    return Mesh(grid, AXES)


def initialize_distributed() -> bool:
    """Call `jax.distributed.initialize()` when a multi-process launch is detected; returns whether it did."""
    if os.environ.get("JAX_COORDINATOR_ADDRESS") or os.environ.get("COORDINATOR_ADDRESS"):
        jax.distributed.initialize()
        return True
    return False
