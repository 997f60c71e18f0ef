"""Paged-cache addressing shared by the ops and `kimi_jax.paged_cache` (one definition of where a token lives).

A pool part is an array `[num_blocks, page, width]`; a sequence's block table `[max_blocks]` lists its pages in
order, so sequence position p lives at row `table[p // page]`, slot `p % page`, i.e. flat row
`table[p // page] · page + p % page` of the part reshaped to `[num_blocks · page, width]`.
"""

from __future__ import annotations

import jax.numpy as jnp


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
#   "gpu" / "tpu"               the Pallas kernel for that platform (Triton lowering / Mosaic TPU)
#   "gpu_interpret" / "tpu_interpret"   that kernel in Pallas interpret mode (CPU tests)
#   "auto"                      the platform's kernel when it supports the call (decode, a format it reads), else
#                               the reference
# "pallas_tpu" and "interpret" are the older names of "tpu" and "tpu_interpret".
DSA_BACKENDS = ("auto", "reference", "gpu", "tpu", "gpu_interpret", "tpu_interpret", "pallas_tpu", "interpret")
_ALIASES = {"pallas_tpu": "tpu", "interpret": "tpu_interpret"}
_PLATFORM_KERNEL = {"gpu": "gpu", "cuda": "gpu", "tpu": "tpu"}


def resolve_dsa_backend(backend: str, *, op: str, supported) -> str:
    """The one place the DSA ops pick an implementation. `supported(kind) -> bool` says whether the kernel of kind
    "gpu" / "tpu" handles this call; "auto" falls back to "reference" when it does not (or on CPU). Explicit kernel
    names are returned as asked (the caller raises if the call does not fit)."""
    if backend not in DSA_BACKENDS:
        raise ValueError(f"unknown {op} backend {backend!r}; choose one of {DSA_BACKENDS}")
    if backend != "auto":
        return _ALIASES.get(backend, backend)
    import jax

    kind = _PLATFORM_KERNEL.get(jax.default_backend())
    return kind if kind is not None and supported(kind) else "reference"
