"""Paged-cache addressing shared by the ops and `kimi_jax.paged_cache` (one definition of where a token lives).

A pool part is an array `[num_blocks, page, width]`; a sequence's block table `[max_blocks]` lists its pages in
order, so sequence position p lives at row `table[p // page]`, slot `p % page`, i.e. flat row
`table[p // page] · page + p % page` of the part reshaped to `[num_blocks · page, width]`.
"""

from __future__ import annotations

import os
from typing import Optional

import jax.numpy as jnp

from .platform import resolve_platform


def flat_slots(block_tables, positions, page: int):
    """Flat pool rows `[B, ...]` int32 of sequence positions `[B, ...]` under block tables `[B, max_blocks]`.
    Negative positions and positions past the table are clamped to a valid row (the caller masks them)."""
    block_tables = jnp.asarray(block_tables, jnp.int32)
    positions = jnp.asarray(positions, jnp.int32)
    B, nb = block_tables.shape
    pos = jnp.maximum(positions.reshape(B, -1), 0)
    blk = jnp.take_along_axis(block_tables, jnp.minimum(pos // page, nb - 1), axis=1)
    return (blk * page + pos % page).reshape(positions.shape)


def gather_parts(parts, block_tables, positions):
    """Stored rows at sequence positions: each part `[num_blocks, page, w]` -> `[B, ..., w]` (no dequantisation)."""
    page = parts[0].shape[1]
    slot = flat_slots(block_tables, positions, page)
    return tuple(p.reshape((-1, p.shape[-1]))[slot] for p in parts)


def gather_pages(parts, block_tables):
    """Whole pages in table order: each part `[num_blocks, page, w]` -> `[B, max_blocks · page, w]`."""
    block_tables = jnp.asarray(block_tables, jnp.int32)
    B, nb = block_tables.shape
    return tuple(p[block_tables].reshape(B, nb * p.shape[1], p.shape[-1]) for p in parts)


# ------------------------------------------------------------------------------------------------ backend choice

# Implementations of the paged DSA ops (pallas_kernels.indexer.paged, pallas_kernels.mla.sparse):
#   "reference"                 plain jnp (every platform, every shape)
#   "gpu"                       the native Triton GPU kernel, launched through jax-triton (docs/gpu.md)
#   "tpu"                       the Pallas Mosaic TPU kernel
#   "gpu_interpret"             the Triton kernel in Triton's interpreter (CPU tests; TRITON_INTERPRET=1)
#   "tpu_interpret"             the TPU kernel in Pallas interpret mode (CPU tests)
#   "auto"                      the platform's kernel when it supports the call (decode, a format it reads), else
#                               the reference; the platform is the ops' `platform=` argument ("cpu" | "tpu" |
#                               "gpu" / "cuda"; None = jax.default_backend() at trace time)
# Other names: "triton" / "triton_interpret" for "gpu" / "gpu_interpret", and the older "pallas_tpu" / "interpret"
# for "tpu" / "tpu_interpret".
DSA_BACKENDS = ("auto", "reference", "gpu", "tpu", "gpu_interpret", "tpu_interpret", "triton", "triton_interpret",
                "pallas_tpu", "interpret")
_ALIASES = {"triton": "gpu", "triton_interpret": "gpu_interpret", "pallas_tpu": "tpu", "interpret": "tpu_interpret"}
_PLATFORM_KERNEL = {"gpu": "gpu", "tpu": "tpu"}


def canonical_dsa_backend(backend: str) -> str:
    """A DSA backend name with its other names resolved ("triton" -> "gpu", "interpret" -> "tpu_interpret", ...)."""
    return _ALIASES.get(backend, backend)


DSA_PRECISIONS = ("exact", "storage")


def check_precision(precision: str) -> None:
    """The DSA ops' `precision`: "exact" (products to ≈ fp32 against the dequantised cache) or "storage" (faster
    single-pass kernel settings within the quantised storage formats' 5e-3 bar)."""
    if precision not in DSA_PRECISIONS:
        raise ValueError(f"DSA precision must be one of {DSA_PRECISIONS}, got {precision!r}")


def resolve_dsa_backend(backend: str, *, op: str, supported, platform: Optional[str] = None) -> str:
    """The one place the DSA ops pick an implementation. `supported(kind) -> bool` says whether the kernel of kind
    "gpu" / "tpu" handles this call; "auto" takes the kernel of `platform` (None: the default backend's platform)
    and falls back to "reference" when it does not (or on CPU). Explicit kernel names are returned as asked, other
    names resolved (the caller raises if the call does not fit)."""
    if backend not in DSA_BACKENDS:
        raise ValueError(f"unknown {op} backend {backend!r}; choose one of {DSA_BACKENDS}")
    if backend != "auto":
        return canonical_dsa_backend(backend)
    # Escape hatch for deployments (and the bench scripts): KIMI_JAX_DSA_BACKEND=reference keeps "auto" on the jnp
    # path without touching code, e.g. while a kernel is suspected on a new jax / driver version.
    forced = os.environ.get("KIMI_JAX_DSA_BACKEND", "").strip().lower()
    if forced and forced != "auto":
        if forced not in DSA_BACKENDS:
            raise ValueError(f"KIMI_JAX_DSA_BACKEND={forced!r}: choose one of {DSA_BACKENDS}")
        return canonical_dsa_backend(forced)
    kind = _PLATFORM_KERNEL.get(resolve_platform(platform))
    return kind if kind is not None and supported(kind) else "reference"
