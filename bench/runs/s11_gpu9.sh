# Session 11, call 9: the Mosaic GPU MXFP4 kernel with the decode's constants as operands
# (mx.DECODE_PTX_SIGN_OPERANDS, -192*h once per group) and x's two planes in one copy per step; the fp8 path's kernel
# timed alone this time (calls 7-8 timed the bf16 kernel at its row count for it). Tests, timing, SASS dump.
source bench/device_env.sh
export PATH=/usr/local/cuda/bin:$PATH
JAX_PLATFORMS=cuda timeout 200 python3 -m pytest -q -m gpu tests/test_moe_kernels.py -k mgpu 2>&1 | grep -E "passed|failed|Error|assert" | tail -8
timeout 240 python3 bench/moe.py --no-ep --mxfp4-only --q-rows 8,32 --budget 220 --q-configs '[{}]' --mgpu-configs '[{}, {"rows": 8}, {"rows": 8, "kh": 256, "steps": 3}, {"rows": 8, "ctas_per_sm": 3, "steps": 3}, {"kh": 256, "steps": 3}, {"mma": "fp8", "rows": 8, "kh": 256, "steps": 4}, {"mma": "fp8", "rows": 8}]' 2>&1 | grep -E "MXFP4 |FAIL|Error" | cut -c1-300
mkdir -p $OUT/dump
MOSAIC_GPU_DUMP_TO=$OUT/dump MOSAIC_GPU_DUMP_SASS=1 MOSAIC_GPU_DUMP_PTX=1 timeout 60 python3 -c "
import jax, jax.numpy as jnp
from pallas_kernels.moe import mgpu_mxfp4 as mm, mxfp4 as mx
E, K, N = 112, 3584, 3072
w = mm.prepare_weight(mx.random_weight(jax.random.key(3), E, K, N))
x = jax.random.normal(jax.random.key(1), (E * 8, K), jnp.bfloat16)
print(mm.grouped_matmul(x, w, jnp.full((E,), 8, jnp.int32), config=mm.MgpuConfig(rows=8)).block_until_ready().shape)
" > $OUT/dump/stdout.txt 2>&1; ls $OUT/dump | head; tail -3 $OUT/dump/stdout.txt
