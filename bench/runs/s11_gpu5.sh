# Session 11, call 5: the Mosaic GPU MXFP4 kernel with the accumulator kept across steps (no per-step wgmma wait),
# rows per tile = the group size class, XLA prep without searchsorted: tests, timing at 8/32/64 rows, its SASS, ncu.
source bench/device_env.sh
JAX_PLATFORMS=cuda timeout 200 python3 -m pytest -q -m gpu tests/test_moe_kernels.py -k mgpu -x 2>&1 | grep -v Deprecat | tail -4
timeout 240 python3 bench/moe.py --no-ep --mxfp4-only --q-rows 8,32,64 --budget 220 --q-configs '[{}]' --mgpu-configs '[{}, {"steps": 6}, {"ctas_per_sm": 3, "steps": 3}, {"kh": 256, "steps": 3}, {"ctas_per_sm": 1, "steps": 8}]' 2>&1 | grep -E "MXFP4 |FAIL|Error" | cut -c1-300
mkdir -p $OUT/dump
MOSAIC_GPU_DUMP_TO=$OUT/dump MOSAIC_GPU_DUMP_SASS=1 MOSAIC_GPU_DUMP_PTX=1 timeout 60 python3 -c "
import jax, jax.numpy as jnp
from pallas_kernels.moe import mgpu_mxfp4 as mm, mxfp4 as mx
E, K, N = 112, 3584, 3072
w = mm.prepare_weight(mx.random_weight(jax.random.key(3), E, K, N))
x = jax.random.normal(jax.random.key(1), (E * 8, K), jnp.bfloat16)
print(mm.grouped_matmul(x, w, jnp.full((E,), 8, jnp.int32)).block_until_ready().shape)
" > $OUT/dump/stdout.txt 2>&1; ls -la $OUT/dump | head; grep -c "" $OUT/dump/stdout.txt
timeout 150 /usr/local/cuda/bin/ncu --clock-control none -k 'regex:mosaic|body|kernel_call' -c 1 --section LaunchStats --section Occupancy --section WarpStateStats --section SpeedOfLight python3 bench/moe.py --no-ep --mxfp4-only --q-rows 8 --budget 100 --q-configs '[]' --mgpu-configs '[{}]' 2>&1 | grep -E "Duration|Registers|Warp Cycles Per Issued|Issue Slots|Achieved Occupancy|DRAM Throughput|Memory Throughput|Shared Memory Config|Block Limit|Theoretical Occ|Stall|==PROF==|mosaic" | head -30
