"""On-chip memory budgets of the Mosaic TPU kernels: what a kernel's blocks and scalar-prefetch tables take in VMEM
and SMEM, computed from shapes, and checked before a kernel is built.

Budgets (per TensorCore):
- VMEM: 16 MiB, Mosaic's default scoped VMEM limit on v5e (`CompilerParams.vmem_limit_bytes` /
  `--xla_tpu_scoped_vmem_limit_kib` raise it; v6e and v7 default to 32 MiB; physical VMEM is 128 MiB on v5e / v6e,
  64 MiB on v7, `jax._src.pallas.mosaic.tpu_info`). A kernel that fits 16 MiB fits every generation's default.
- SMEM: 1 MiB physical on v4 … v7 (`tpu_info.smem_capacity_bytes`); scalar-prefetch tables are kept to half of it,
  the rest left to Mosaic's own scalars. Kernels whose tables grow with batch × length split the batch into calls
  that each fit (`batch_rows_within`).

Block bytes are counted as Mosaic lays them out: the last dim padded to 128 lanes and the second-to-last to the
dtype's sublane tile (8 rows of 32 bit, 16 of 16 bit, 32 of 8 bit); pipelined blocks are double-buffered.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

VMEM_BUDGET = 16 << 20
SMEM_BUDGET = 512 << 10  # scalar-prefetch tables: half of the 1 MiB SMEM
LANES = 128


def _round_up(n: int, m: int) -> int:
    return -(-int(n) // m) * m


def tile_bytes(shape, dtype) -> int:
    """Bytes of one VMEM buffer of `shape` (leading dims kept, the last two padded to the (sublane, lane) tile)."""
    itemsize = np.dtype(dtype).itemsize
    shape = tuple(int(s) for s in shape) or (1,)
    if len(shape) == 1:
        shape = (1,) + shape
    *lead, rows, cols = shape
    sub = 8 * max(1, 4 // itemsize)
    n = _round_up(rows, sub) * _round_up(cols, LANES) * itemsize
    for s in lead:
        n *= s
    return n


def smem_bytes(*sizes: int) -> int:
    """Bytes of int32 scalar-prefetch tables with these element counts (each padded to 512 B)."""
    return sum(_round_up(4 * int(n), 512) for n in sizes)


class BudgetError(ValueError):
    """A kernel's blocks or tables do not fit the on-chip memory budget."""


def check(kernel: str, *, vmem: int, smem: int, vmem_budget: int = VMEM_BUDGET, smem_budget: int = SMEM_BUDGET):
    """Raise `BudgetError` naming the kernel when its VMEM or SMEM bytes exceed the budget."""
    if vmem > vmem_budget:
        raise BudgetError(f"{kernel}: {vmem / 2**20:.2f} MiB of VMEM blocks exceed the {vmem_budget / 2**20:.0f} MiB "
                          "budget; use a smaller block or shard the heads")
    if smem > smem_budget:
        raise BudgetError(f"{kernel}: {smem / 2**10:.0f} KiB of SMEM tables exceed the {smem_budget / 2**10:.0f} KiB "
                          "budget")


def batch_rows_within(batch: int, per_row_smem: int, fixed_smem: int = 0, smem_budget: int = SMEM_BUDGET) -> int:
    """The most batch rows per kernel call whose tables (`per_row_smem` bytes per row plus `fixed_smem`) fit."""
    rows = (smem_budget - fixed_smem) // max(1, per_row_smem)
    if rows < 1:
        raise BudgetError(f"one batch row's scalar tables ({per_row_smem / 2**10:.0f} KiB) exceed the "
                          f"{smem_budget / 2**10:.0f} KiB SMEM budget")
    return int(min(batch, rows))


def over_batch(fn, batch: int, rows_per_call: int, *arrays):
    """`fn(*slices)` on consecutive batch slices of `arrays` (leading dim = batch), outputs concatenated on axis 0:
    how a kernel whose scalar tables grow with the batch stays within SMEM."""
    if rows_per_call >= batch:
        return fn(*arrays)
    outs = [fn(*(a[s:s + rows_per_call] for a in arrays)) for s in range(0, batch, rows_per_call)]
    return jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *outs)
