"""Device meshes from the CLI's `--mesh` forms.

Physical mesh axes, outermost first: ("data", "context", "model").
* "data"    — independent sequences (batch).
* "context" — one sequence's tokens (token-split prefill, decode context parallelism; `sharding.context_parallel`).
* "model"   — tensor parallelism: KDA / MLA heads and the vocabulary split over it (`sharding.rules`).
Routed experts are an overlay on the same devices: they split over "model" (expert = tensor), or over
("context", "model") together (expert = context × tensor) — the vLLM K3.1 layout `expert=8,tensor=1,context=8` runs
attention token-split over 8 devices and the experts 8-way over those same devices.

Forms:
* `AxB`: A-way model (tensor) parallelism × B-way data parallelism over A·B devices (context 1, experts over "model").
* named: `data=2,tensor=4` / `expert=8,tensor=1,context=8` / `model=4,data=2` ("model" is an alias of "tensor").
  Devices = data × context × tensor. `expert` defaults to tensor and must equal tensor or context × tensor.
Multi-host: call `jax.distributed.initialize()` first (`initialize_distributed()` does it when the standard
environment variables are present).
"""

from __future__ import annotations

import os
from typing import Optional

import jax
import numpy as np
from jax.sharding import Mesh

AXES = ("data", "context", "model")
NAMED = ("data", "context", "tensor", "model", "expert")

# Mesh -> the mesh axes routed experts split over. Meshes are hashable and interned by JAX, so a plain dict is a
# registry that outlives no more than the meshes themselves (a handful per process).
_EXPERT_AXES: dict = {}


class MeshError(ValueError):
    """A mesh that cannot be built on the devices at hand, or a spec that names it wrongly."""


def parse_mesh_spec(text: str) -> dict[str, int]:
    """'8x1' -> {'data': 1, 'context': 1, 'model': 8, 'expert': 8};
    'expert=8,tensor=1,context=8' -> {'data': 1, 'context': 8, 'model': 1, 'expert': 8}.

    `expert` is how many ways the routed experts split: tensor (over "model") or context × tensor
    (over ("context", "model"))."""
    text = text.strip().lower()
    try:
        if "=" in text:
            sizes = {}
            for part in text.split(","):
                k, v = (s.strip() for s in part.split("="))
                if k not in NAMED:
                    raise MeshError(f"unknown mesh axis {k!r}; known axes: {', '.join(NAMED)} "
                                    "(tensor and model are the same axis)")
                k = "model" if k == "tensor" else k
                if k in sizes:
                    raise MeshError(f"mesh axis {k!r} given twice in {text!r} (tensor and model are the same axis)")
                sizes[k] = int(v)
        else:
            a, b = text.split("x")
            sizes = {"model": int(a), "data": int(b)}
    except MeshError:
        raise
    except Exception:  # noqa: BLE001
        raise MeshError(f"--mesh must look like AxB (model x data) or a named form such as "
                        f"expert=8,tensor=1,context=8 or model=4,data=2; got {text!r}") from None
    if any(v < 1 for v in sizes.values()):
        raise MeshError(f"mesh axis sizes must be positive, got {sizes}")
    out = {axis: sizes.get(axis, 1) for axis in AXES}
    out["expert"] = sizes.get("expert", out["model"])
    _expert_axes_for(out)  # validates
    return out


def _expert_axes_for(sizes: dict) -> tuple:
    e, m, c = sizes.get("expert", sizes["model"]), sizes["model"], sizes["context"]
    if e == m:
        return ("model",)
    if e == m * c:
        return ("context", "model")
    raise MeshError(f"expert={e} must equal tensor ({m}: experts split over the tensor axis) or context x tensor "
                    f"({c} x {m} = {c * m}: experts split over the same devices as the context and tensor axes)")


def make_mesh(spec: str | dict, devices=None) -> Mesh:
    """A `jax.sharding.Mesh` with axes ("data", "context", "model") over the first data·context·model devices.
    `spec`: a `--mesh` string or a dict of axis sizes (keys as `parse_mesh_spec` returns; missing axes are 1)."""
    if isinstance(spec, str):
        sizes = parse_mesh_spec(spec)
    else:
        bad = set(spec) - set(NAMED)
        if bad:
            raise MeshError(f"unknown mesh axes {sorted(bad)}; known axes: {', '.join(NAMED)}")
        sizes = {a: int(spec.get(a, spec.get("tensor", 1) if a == "model" else 1)) for a in AXES}
        sizes["expert"] = int(spec.get("expert", sizes["model"]))
    expert_axes = _expert_axes_for(sizes)
    devices = list(jax.devices()) if devices is None else list(devices)
    need = sizes["data"] * sizes["context"] * sizes["model"]
    if need > len(devices):
        hint = ""
        if devices and devices[0].platform == "cpu":
            hint = (f" On CPU, fake {need} devices with XLA_FLAGS=--xla_force_host_platform_device_count={need} "
                    "(set it before Python starts).")
        raise MeshError(f"mesh data={sizes['data']} x context={sizes['context']} x model={sizes['model']} needs "
                        f"{need} devices but only {len(devices)} "
                        f"{devices[0].platform if devices else ''} device(s) exist.{hint}")
    grid = np.array(devices[:need]).reshape(sizes["data"], sizes["context"], sizes["model"])
    mesh = Mesh(grid, AXES)
    _EXPERT_AXES[mesh] = expert_axes
    return mesh


def expert_axes(mesh: Mesh) -> tuple:
    """The mesh axes routed experts split over: what `make_mesh` recorded, else ("model",) — restricted to the
    axes this mesh has."""
    axes = _EXPERT_AXES.get(mesh, ("model",))
    return tuple(a for a in axes if a in mesh.axis_names)


def mesh_sizes(mesh: Mesh) -> dict[str, int]:
    """{data, context, model} sizes of any mesh (absent axes count as 1)."""
    return {a: int(mesh.shape.get(a, 1)) for a in AXES}


def mesh_platform(mesh: Optional[Mesh]) -> str:
    """The platform programs over `mesh` run on ("cpu" | "gpu" | "tpu"); JAX's default backend for None or for an
    abstract mesh (no devices: nothing runs on it)."""
    devices = getattr(mesh, "devices", None)
    return devices.flat[0].platform if devices is not None else jax.default_backend()


FAKE_DEVICES_FLAG = "--xla_force_host_platform_device_count"


def fake_cpu_devices(n: int) -> bool:
    """Ask JAX for `n` CPU devices, if that can still take effect; returns whether it was set.

    JAX reads the CPU device count once, when it starts its backends, so this must run before anything touches a
    device.  `jax_num_cpu_devices` is the config form of XLA_FLAGS=--xla_force_host_platform_device_count=N (no
    re-exec needed).  A count the user chose in XLA_FLAGS or in the config wins: we never override it.
    """
    if FAKE_DEVICES_FLAG in os.environ.get("XLA_FLAGS", "") or getattr(jax.config, "jax_num_cpu_devices", -1) > 0:
        return False
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:  # the backends are already up (JAX refuses the change): too late in this process
        return False
    return True


def initialize_distributed(coordinator_address: Optional[str] = None, num_processes: Optional[int] = None,
                           process_id: Optional[int] = None, *, auto: bool = False,
                           heartbeat_timeout_s: int = 100) -> bool:
    """Start `jax.distributed` when this is one process of several; returns whether it did.

    A launch is multi-process when a coordinator address is given (here, or JAX_COORDINATOR_ADDRESS /
    COORDINATOR_ADDRESS), with the process count and this process's index from the arguments or
    JAX_NUM_PROCESSES / JAX_PROCESS_ID; or with ``auto``, where JAX detects the cluster itself (TPU pod slices,
    SLURM, Open MPI). CPU collectives between processes run over gloo. A process that misses heartbeats for
    ``heartbeat_timeout_s`` seconds stops every other one (JAX's coordination service): a dead peer is an exit,
    never a hang. Must run before anything touches a device."""
    env = os.environ
    address = coordinator_address or env.get("JAX_COORDINATOR_ADDRESS") or env.get("COORDINATOR_ADDRESS")
    if not address and not auto:
        return False
    if num_processes is None and env.get("JAX_NUM_PROCESSES"):
        num_processes = int(env["JAX_NUM_PROCESSES"])
    if process_id is None and env.get("JAX_PROCESS_ID"):
        process_id = int(env["JAX_PROCESS_ID"])
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # only the CPU client reads it
    jax.distributed.initialize(address or None, num_processes, process_id,
                               heartbeat_timeout_seconds=int(heartbeat_timeout_s))
    return True


def distributed_process() -> tuple[int, int]:
    """(this process's index, the number of processes) of the `jax.distributed` run, (0, 1) without one; unlike
    `jax.process_index()` it does not start the backends (the fake CPU device count can still be set after it)."""
    from jax._src import distributed  # the run's state before any backend exists; not public API

    state = distributed.global_state
    if state.client is None:
        return 0, 1
    return int(state.process_id), int(state.num_processes)
