# Session 32, call 3. Issue #6: the tile-layout matmul applies the placed layout's expert factor inside the kernel
# (before: an XLA multiply over the whole fp32 output). GPU tests, then one tile-layout matmul and the FFN timed
# (bench/moe.py's FFN section at 8 / 32 / 64 rows per expert; session 32 call 1 is the before).
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 250 python3 -m pytest -x -q -m gpu tests/test_moe_kernels.py \
  -k "placed_with_large or ops_run_prepared or tiled_expert_ffn or three_compute" 2>&1 | tail -4
mkdir -p $OUT/sub
OUT=$OUT/sub timeout 300 python3 bench/moe.py --no-ep --ffn-only --ffn-sizes routed --ffn-no-peers --ffn-rows 8,32,64 \
  2>&1 | grep -E "tile layout [0-9]|copy|ERROR|rror" | cut -c1-300
