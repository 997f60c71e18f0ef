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
