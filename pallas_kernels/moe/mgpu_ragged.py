"""JAX's bundled Mosaic GPU grouped matmul (`jax.experimental.pallas.ops.gpu.ragged_dot_mgpu`, Hopper, bf16 dense
weights) as the MoE ops' "mgpu" backend: `mgpu_grouped_matmul(x [M, K], w [E, K, N], group_sizes [E])` -> `[M, N]`.
Measured beside the Triton kernel (bench/moe.py): at K3 shapes on an H200 it ran 270 TFLOP/s (best of 4 configs),
the Triton kernel 389, which is why `ops.GPU_CHOICE` takes the Triton kernel."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class MgpuConfig:
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    max_concurrent_steps: int = 4
    grid_block_n: int = 1


def mgpu_grouped_matmul(x, w, group_sizes, *, out_dtype=jnp.float32, config: MgpuConfig | None = None):
    """JAX's bundled Hopper kernel (`jax.experimental.pallas.ops.gpu.ragged_dot_mgpu`); bf16 dense weights only.
    Its output is in x's dtype; tiles that straddle groups are computed once per group."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    c = config or MgpuConfig()
    out = ragged_dot_mgpu.ragged_dot(x, w.astype(x.dtype), group_sizes=group_sizes.astype(jnp.int32),
                                     block_m=c.block_m, block_n=c.block_n, block_k=c.block_k,
                                     max_concurrent_steps=c.max_concurrent_steps, grid_block_n=c.grid_block_n)
    return out.astype(out_dtype)
