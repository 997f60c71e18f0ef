"""What a forward pass depends on besides parameters and caches: one small frozen `ForwardContext`.

Every module call takes it explicitly (no ContextVar, no module-level switch): the device mesh and the role of each
of its axes, the mode of the program being traced, which kernel implementation each op family runs, and the
platform that "auto" resolves against. The partitioned op entry points (`sharding.kda`, `sharding.dsa`,
`sharding.moe`) read it to wrap their kernel in a `shard_map` with the op's own specs.

Modes:
* "plain"                — any number of tokens; the mesh's axes are automatic (GSPMD) outside the op entry points.
* "prefill_token_split"  — traced inside a shard_map that is manual over the context (and data) axes: this device
                           holds a contiguous slice of a fresh prompt of `valid_len` real tokens.
* "prefill_head_split"   — all tokens on every device; MLA query-chunked over the whole prompt.
* "decode_dcp"           — one token per sequence, traced manual over context: the MLA cache is split over the
                           context axis in `layout` order (decode context parallelism).
* "decode_tp"            — one token per sequence, the MLA cache whole on every device, the sparse top-k algorithm.

`dcp` > 1 (the serving engine's paged cache under decode context parallelism, in "plain" programs): the latent
pages and index keys split over `dcp_axis` token by token (see `sharding.dsa`, DCP section).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from pallas_kernels.paged import check_precision

from .mesh import expert_axes

MODES = ("plain", "prefill_token_split", "prefill_head_split", "decode_dcp", "decode_tp")
LAYOUTS = ("contiguous", "round_robin")
DEFAULT_MAX_CHUNK_BYTES = 512 << 20


@dataclass(frozen=True)
class KernelConfig:
    """Which implementation each op family runs: execution policy as data, separate from the architecture.

    "auto" picks per target platform inside each family's entry point: the Pallas TPU kernel on TPU, the GPU kernels
    (native Triton through jax-triton, Pallas Mosaic GPU where a family has one) on GPU where jax-triton can launch,
    the plain-jnp reference elsewhere (CPU). "reference" forces the jnp definition everywhere; the "*_interpret"
    variants run a kernel's code interpreted (CPU tests: TPU kernels in the Pallas interpreter, GPU kernels in
    Triton's). "triton" / "triton_interpret" are other names of "gpu" / "gpu_interpret".
    * kda: auto | reference | gpu | tpu | gpu_interpret | tpu_interpret
    * moe: auto | reference | gpu | mgpu | tpu  (`moe_interpret` runs the chosen MoE kernel interpreted)
    * dsa: the paged MLA path (indexer top-k, sparse and dense paged attention): auto | reference | gpu | tpu |
      gpu_interpret | tpu_interpret. Under "auto" the environment variable KIMI_JAX_DSA_BACKEND=reference is an
      operator's override.
    * norm: RMSNorm (`pallas_kernels.norm`): auto | reference | gpu | gpu_interpret (one Triton kernel per norm for
      decode-sized batches on a GPU instead of XLA's two)
    * dsa_precision: "exact" (≈ fp32 against the dequantised cache) or "storage" (the GPU kernels' single-pass
      settings and the dense paged reference's bf16 products, within the quantised formats' 5e-3 bar). The TPU
      kernels and the other references do not differ.
    """

    kda: str = "auto"
    moe: str = "auto"
    moe_interpret: bool = False
    dsa: str = "auto"
    dsa_precision: str = "exact"
    norm: str = "auto"

    def __post_init__(self):
        check_precision(self.dsa_precision)  # a typo fails here, not at the first decode step

    @staticmethod
    def reference() -> "KernelConfig":
        return KernelConfig(kda="reference", moe="reference", dsa="reference", norm="reference")

    def replaced(self, spec: str) -> "KernelConfig":
        """This config with op families' implementations taken from `spec`, comma-separated FAMILY=BACKEND pairs
        (the server's `--kernels norm=reference,moe=reference`): families kda, moe, dsa and norm, each backend one
        its family names (`auto`, `reference`, `gpu`, `tpu`, ...). Raises ValueError naming what it does not know."""
        if not spec.strip():
            return self
        from pallas_kernels import norm
        from pallas_kernels.kda import ops as kda_ops
        from pallas_kernels.moe import ops as moe_ops
        from pallas_kernels.paged import DSA_BACKENDS

        known = {"kda": ("auto",) + kda_ops.BACKENDS, "moe": ("auto",) + moe_ops.BACKENDS, "dsa": DSA_BACKENDS,
                 "norm": ("auto",) + norm.BACKENDS}
        fields = {}
        for pair in filter(None, (part.strip() for part in spec.split(","))):
            family, _, backend = (s.strip().lower() for s in pair.partition("="))
            if family not in known:
                raise ValueError(f"unknown kernel family {family!r} in {pair!r}; families: {', '.join(known)}")
            if backend not in known[family]:
                raise ValueError(f"unknown {family} backend {backend!r}; choose one of {', '.join(known[family])}")
            fields[family] = backend
        return dataclasses.replace(self, **fields)


@dataclass(frozen=True)
class AxisRoles:
    """Mesh axis names by role. `expert`: the axes the routed experts split over ("model", or ("context", "model")
    on the overlay meshes such as `expert=8,tensor=1,context=8`)."""

    data: str = "data"
    tensor: str = "model"
    context: str = "context"
    expert: tuple = ("model",)


@dataclass(frozen=True)
class ForwardContext:
    """Everything a forward depends on that is neither a parameter nor a cache (see the module doc for `mode`).

    mesh: None (one device, kernels called directly) or the `jax.sharding.Mesh` the program runs on.
    platform: the platform "auto" kernels resolve against ("cpu" | "tpu" | "gpu"); None = `jax.default_backend()`.
    valid_len: real prompt tokens (token-split prefill; the rest of the last shard is inert padding).
    layout: the MLA cache order over the context axis under DCP ("contiguous" | "round_robin").
    max_chunk_bytes: the query-chunk bound of the context-parallel MLA attention.
    """

    mesh: Optional[Mesh] = None
    kernels: KernelConfig = KernelConfig()
    platform: Optional[str] = None
    mode: str = "plain"
    axes: AxisRoles = AxisRoles()
    valid_len: int = 0
    layout: str = "contiguous"
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES
    dcp: int = 1

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"unknown forward mode {self.mode!r}; choose one of {MODES}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown DCP layout {self.layout!r}; choose one of {LAYOUTS}")
        if self.dcp > 1:
            self.dcp_axis  # noqa: B018  (validates)

    @property
    def dcp_axis(self) -> str:
        """The mesh axis the paged cache's tokens split over under decode context parallelism (`dcp` > 1): the
        context axis when the mesh has one of that size, else the tensor axis (as vLLM runs DCP inside the tensor
        group: attention weights stay split by heads, the cache by tokens)."""
        for axis in (self.axes.context, self.axes.tensor):
            if self.axis_size(axis) == self.dcp:
                return axis
        raise ValueError(f"--dcp {self.dcp} must equal the tensor axis size ({self.axis_size(self.axes.tensor)}) or "
                         f"the context axis size ({self.axis_size(self.axes.context)}) of the mesh")

    def replace(self, **changes) -> "ForwardContext":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------------------------------------ mesh facts
    def axis_size(self, axis: str) -> int:
        """Size of a mesh axis (1 without a mesh or when the mesh lacks it)."""
        if self.mesh is None:
            return 1
        return int(self.mesh.shape.get(axis, 1))

    @property
    def context_size(self) -> int:
        return self.axis_size(self.axes.context)

    @property
    def context_parallel(self) -> bool:
        """Traced inside a program that is manual over the context axis (token-split prefill or DCP decode)."""
        return self.mode in ("prefill_token_split", "decode_dcp")

    @property
    def token_split(self) -> bool:
        return self.mode == "prefill_token_split"

    @property
    def splits_mla(self) -> bool:
        """The MLA layers run the context-parallel programs' attention (contiguous caches, query-chunked)."""
        return self.mode != "plain"

    def platform_kw(self) -> dict:
        """`platform=` for the kernel families' entry points, when this context names one."""
        return {} if self.platform is None else {"platform": self.platform}

    # ------------------------------------------------------------------------------------------------ token split
    def first_token(self, tokens_per_device: int):
        """The global position of this device's first token (token split), else 0."""
        if self.mode != "prefill_token_split":
            return 0
        return jax.lax.axis_index(self.axes.context) * tokens_per_device

    def token_mask(self, tokens_per_device: int):
        """`[T]` bool: which of this device's tokens are real prompt tokens (not end padding)."""
        pos = self.first_token(tokens_per_device) + jnp.arange(tokens_per_device, dtype=jnp.int32)
        return pos < self.valid_len

    def slot_positions(self, slots: int):
        """`[L]` global position held by each of this device's L contiguous-cache slots."""
        if not self.context_parallel:
            return jnp.arange(slots, dtype=jnp.int32)
        d = jax.lax.axis_index(self.axes.context)
        slot = jnp.arange(slots, dtype=jnp.int32)
        return d * slots + slot if self.layout == "contiguous" else slot * self.context_size + d


def context_for_mesh(mesh: Optional[Mesh], kernels: KernelConfig = KernelConfig(), *,
                     platform: Optional[str] = None, **fields) -> ForwardContext:
    """A `ForwardContext` for `mesh` with its axis roles read off the mesh (the expert axes that
    `sharding.mesh.make_mesh` recorded)."""
    axes = AxisRoles() if mesh is None else AxisRoles(expert=expert_axes(mesh) or ("model",))
    return ForwardContext(mesh=mesh, kernels=kernels, platform=platform, axes=axes, **fields)
