"""Session 16: which XLA kernels surround the Mosaic MXFP4 op (8 rows per expert), for ncu's per-kernel summary."""
import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.moe import mgpu_mxfp4 as mm
from pallas_kernels.moe import mxfp4 as mx

E, K, N, M = 112, 3584, 3072, 896
w = mm.prepare_weight(mx.random_weight(jax.random.key(0), E, K, N))
cuts = np.sort(np.random.default_rng(0).integers(0, M + 1, E - 1))
sizes = jnp.asarray(np.diff(np.concatenate([[0], cuts, [M]])), jnp.int32)
x = jax.random.normal(jax.random.key(1), (M, K), jnp.bfloat16)
f = jax.jit(lambda a, w_, g: mm.grouped_matmul(a, w_, g, out_dtype=jnp.bfloat16))
for _ in range(3):
    f(x, w, sizes).block_until_ready()
