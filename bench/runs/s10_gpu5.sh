# Session 10, call 5: why the fp8-tensor-core MXFP4 kernel is 2.4x slower than asm_sign despite fewer instructions:
# ncu warp-state stalls, occupancy and launch stats of one call at 8 rows per expert (K3 shapes).
source bench/device_env.sh
cat > /tmp/one.py <<'PY'
import sys, jax, jax.numpy as jnp
sys.path.insert(0, ".")
from pallas_kernels.moe import gpu, mxfp4 as mx
E, K, N = 112, 3584, 3072
x = jax.random.normal(jax.random.key(0), (E * 8, K), jnp.bfloat16)
w = mx.random_weight(jax.random.key(1), E, K, N)
gs = jnp.full((E,), 8, jnp.int32)
cfg = gpu.GpuConfig(bm=16, bn=128, bk=256, num_warps=8, num_stages=3, swap_ab=True, dequant=sys.argv[1])
if sys.argv[1] == "asm_sign":
    cfg = gpu.GpuConfig(bm=16, bn=64, bk=256, num_warps=4, num_stages=3, dequant="asm_sign")
f = jax.jit(lambda a, b, g: gpu.grouped_matmul(a, (b,), g, config=cfg))
f(x, w, gs).block_until_ready()
PY
for form in fp8 asm_sign; do
timeout 200 /usr/local/cuda/bin/ncu --clock-control none -k regex:moe_grouped_matmul_q -c 1 --section LaunchStats \
  --section Occupancy --section WarpStateStats --section SpeedOfLight python3 /tmp/one.py $form 2>&1 \
  | grep -E "Duration|Registers|Shared Memory Config|Dynamic Shared|Achieved Occupancy|Theoretical Occupancy|Block Limit|Stall|Warp Cycles|DRAM Throughput|Compute \(SM\)|Issued|Waves|Grid Size|Block Size" | head -40
done
