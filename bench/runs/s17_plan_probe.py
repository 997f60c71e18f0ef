"""Session 17: the Mosaic MXFP4 kernel under ncu, the in-kernel group plan vs the XLA plan (argv[1] rows per expert), one
call each after a warm-up, to compare registers, occupancy and warp stalls."""
import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.moe import mgpu_mxfp4 as mm
from pallas_kernels.moe import mxfp4 as mx

E, K, N = 112, 3584, 3072
rows = int(sys.argv[1]) if len(sys.argv) > 1 else 8  # rows per expert
M = rows * E
w = mm.prepare_weight(mx.random_weight(jax.random.key(0), E, K, N))
cuts = np.sort(np.random.default_rng(0).integers(0, M + 1, E - 1))
sizes = jnp.asarray(np.diff(np.concatenate([[0], cuts, [M]])), jnp.int32)
x = jax.random.normal(jax.random.key(1), (M, K), jnp.bfloat16)
for plan in ("kernel", "xla"):
    cfg = mm.config_for(M, w)
    import dataclasses
    cfg = dataclasses.replace(cfg, plan=plan)
    f = jax.jit(lambda a, w_, g, cfg=cfg: mm.grouped_matmul(a, w_, g, config=cfg, out_dtype=jnp.bfloat16))
    for _ in range(2):
        f(x, w, sizes).block_until_ready()
