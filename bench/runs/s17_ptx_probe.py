"""Session 17: dump the PTX of Mosaic MXFP4 kernel variants (8 rows per expert) for `ptxas -v` / SASS comparison on
the CPU: the XLA plan at 8- and 16-row tiles and the in-kernel plan (R + 8 = 16-row MMA)."""
import dataclasses
import os
import sys

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
base = mm.default_config(8)
variants = dict(xla8=dataclasses.replace(base, plan="xla", ctas_per_sm=5),
                xla16=dataclasses.replace(base, plan="xla", rows=16, ctas_per_sm=5),
                kernel8=base)
out = sys.argv[1]
for name, cfg in variants.items():
    os.environ["MOSAIC_GPU_DUMP_TO"] = os.path.join(out, name)
    os.makedirs(os.path.join(out, name), exist_ok=True)
    jax.jit(lambda a, w_, g, cfg=cfg: mm.grouped_matmul(a, w_, g, config=cfg))(x, w, sizes).block_until_ready()
    print(name, "ok", flush=True)
