# Session 17, call 5: the in-kernel plan's registers. The store's int32 splats are now made after the pipeline (not
# live across it); sweep narrower steps (kh = 64: half the decoded registers) with more CTAs per SM at 8 rows per
# expert, and dump the PTX of the kernel plan's default for ptxas -v here.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 200 python3 bench/moe.py --no-ep --mxfp4-only --q-rows 8 --budget 190 --q-configs '[]' --mgpu-configs '[{"ctas_per_sm": 4}, {"ctas_per_sm": 5}, {"kh": 64, "ctas_per_sm": 5}, {"kh": 64, "ctas_per_sm": 6, "steps": 4}, {"kh": 64, "ctas_per_sm": 4, "steps": 4}, {"ctas_per_sm": 5, "plan": "xla"}]' 2>&1 | grep -E "MXFP4 .*rows|Error|copy" | sed -E 's/mma=.bf16., store=.rows., //' | cut -c1-300
mkdir -p $OUT/dump
MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_TO=$OUT/dump timeout 100 python3 -c "
import jax, jax.numpy as jnp, numpy as np
from pallas_kernels.moe import mgpu_mxfp4 as mm, mxfp4 as mx
E, K, N, M = 112, 3584, 3072, 896
w = mm.prepare_weight(mx.random_weight(jax.random.key(0), E, K, N))
x = jax.random.normal(jax.random.key(1), (M, K), jnp.bfloat16)
gs = jnp.full((E,), 8, jnp.int32)
mm.grouped_matmul(x, w, gs).block_until_ready()
"
find $OUT/dump -type f ! -name "*.ptx" -delete; ls $OUT/dump | head
