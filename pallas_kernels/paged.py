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
#   "gpu" / "tpu"               the Pallas kernel for that platform (Triton lowering / Mosaic TPU)
#   "triton"                    the native Triton GPU kernel, launched through jax-triton (issue #48: it replaces
#                               "gpu"'s Pallas Triton lowering once measured beside it)
#   "gpu_interpret" / "tpu_interpret"   that kernel in Pallas interpret mode (CPU tests)
#   "triton_interpret"          the native Triton kernel in Triton's interpreter (CPU tests, TRITON_INTERPRET=1)
#   "auto"                      the platform's kernel when it supports the call (decode, a format it reads), else
#                               the reference; the platform is the ops' `platform=` argument ("cpu" | "tpu" |
#                               "gpu" / "cuda"; None = jax.default_backend() at trace time)
# "pallas_tpu" and "interpret" are the older names of "tpu" and "tpu_interpret".
DSA_BACKENDS = ("auto", "reference", "gpu", "tpu", "triton", "gpu_interpret", "tpu_interpret", "triton_interpret",
                "pallas_tpu", "interpret")
_ALIASES = {"pallas_tpu": "tpu", "interpret": "tpu_interpret"}
_PLATFORM_KERNEL = {"gpu": "gpu", "tpu": "tpu"}


DSA_PRECISIONS = ("exact", "storage")


def check_precision(precision: str) -> None:
    """The DSA ops' `precision`: "exact" (products to ≈ fp32 against the dequantised cache) or "storage" (faster
    single-pass kernel settings within the quantised storage formats' 5e-3 bar)."""
    if precision not in DSA_PRECISIONS:
        raise ValueError(f"DSA precision must be one of {DSA_PRECISIONS}, got {precision!r}")


def resolve_dsa_backend(backend: str, *, op: str, supported, platform: Optional[str] = None) -> str:
    """The one place the DSA ops pick an implementation. `supported(kind) -> bool` says whether the kernel of kind
    "gpu" / "tpu" / "triton" handles this call; "auto" takes the kernel of `platform` (None: the default backend's platform)
    and falls back to "reference" when it does not (or on CPU). Explicit kernel names are returned as asked (the
    caller raises if the call does not fit)."""
    if backend not in DSA_BACKENDS:
        raise ValueError(f"unknown {op} backend {backend!r}; choose one of {DSA_BACKENDS}")
    if backend != "auto":
        return _ALIASES.get(backend, backend)
    # Escape hatch for deployments (and the bench scripts): KIMI_JAX_DSA_BACKEND=reference keeps "auto" on the jnp
    # path without touching code, e.g. while a kernel is suspected on a new jax / driver version.
    forced = os.environ.get("KIMI_JAX_DSA_BACKEND", "").strip().lower()
    if forced and forced != "auto":
        if forced not in DSA_BACKENDS:
            raise ValueError(f"KIMI_JAX_DSA_BACKEND={forced!r}: choose one of {DSA_BACKENDS}")
        return _ALIASES.get(forced, forced)
    kind = _PLATFORM_KERNEL.get(resolve_platform(platform))
    return kind if kind is not None and supported(kind) else "reference"


# ------------------------------------------------------------------------------------------------ Triton addressing

# Why this exists (the CUDA_ERROR_ILLEGAL_ADDRESS of the first H200 run, 128K × 32 fp8 latent pool = 2.4 GB):
# the Pallas Triton lowering (`jax._src.pallas.triton.lowering._compute_offsets_from_indices`, jax 0.10.x / 0.11.x)
# turns every ref access into ONE flat element offset Σ_d index_d · stride_d and picks its integer type from the
# array's size in BYTES: `offset_eltype = i64 if prod(shape) · itemsize > 2**32 else i32`. The offset counts
# ELEMENTS and `tt.addptr` sign-extends it, so a 1-byte array (uint8 / fp8 pool parts) of 2^31 … 2^32 bytes gets
# i32 offsets that wrap negative past row 2^31 / width (fp8 latent, 576 B rows: row ≥ 3.73M, i.e. ~11% of the
# 128K × 32 pool) -> an address ~2 GB below the pool. Splitting the ref's dimensions does not help (the lowering
# sums all dimensions into that one offset). Arrays of ≥ 2 B elements are safe (2^32 B = 2^31 elements at most),
# and so are 1-byte arrays ≤ 2^31 B or > 2^32 B (the lowering's own 64-bit path).
# `ensure_triton_wide_offsets()` closes the gap: it wraps that lowering function so that an array of more than
# 2^31 − 1 elements is presented with a larger leading dimension (strides, which do not depend on dimension 0, and
# the dtype are unchanged), which makes the lowering take its 64-bit path. Nothing else changes; arrays below the
# threshold lower exactly as before. Where jax's internals differ (the wrap cannot be installed), the kernels'
# `supports_pool` checks refuse such pools ("auto" then takes the reference path) instead of faulting.
I32_OFFSET_LIMIT = 2**31 - 1
_WIDE_STATE = {"installed": None}


def _needs_wide(shape, itemsize: int) -> bool:
    n = 1
    for s in shape:
        n *= int(s)
    return n > I32_OFFSET_LIMIT and n * itemsize <= 2**32


def ensure_triton_wide_offsets() -> bool:
    """Install (once) the 64-bit-offset fix described above; True when the installed jax lowering is covered."""
    if _WIDE_STATE["installed"] is not None:
        return _WIDE_STATE["installed"]
    ok = False
    try:
        import dataclasses

        import numpy as np
        from jax._src import core as jax_core
        from jax._src.pallas.triton import lowering as tl

        orig = tl._compute_offsets_from_indices
        if getattr(orig, "_kimi_wide_offsets", False):
            ok = True
        elif "full_shape_dtype" in {f.name for f in dataclasses.fields(tl.BlockInfo)}:

            def _wide(block_info, nd_indexer, *args, **kwargs):
                aval = block_info.full_shape_dtype
                shape = tuple(aval.shape)
                itemsize = np.dtype(aval.dtype).itemsize if str(aval.dtype) not in ("int4", "uint4") else 1
                if shape and _needs_wide(shape, itemsize):
                    row = 1
                    for s in shape[1:]:
                        row *= int(s)
                    lead = (2**32 // max(1, row * itemsize)) + 2  # prod(shape)·itemsize > 2^32: the i64 path
                    block_info = dataclasses.replace(
                        block_info, full_shape_dtype=jax_core.ShapedArray((max(lead, shape[0]),) + shape[1:],
                                                                          aval.dtype))
                return orig(block_info, nd_indexer, *args, **kwargs)

            _wide._kimi_wide_offsets = True
            _wide.__wrapped__ = orig
            tl._compute_offsets_from_indices = _wide
            ok = True
    except Exception:  # noqa: BLE001  (a jax without the Triton lowering, or different internals)
        ok = False
    _WIDE_STATE["installed"] = ok
    return ok


def pool_offsets_safe(parts) -> bool:
    """Whether the Triton kernels can address every row of these pool parts: always when the fix is installed,
    else only when no 1-byte part is in the 2^31 … 2^32-byte window."""
    if ensure_triton_wide_offsets():
        return True
    return not any(_needs_wide(p.shape, p.dtype.itemsize) for p in parts)
