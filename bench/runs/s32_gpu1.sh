# Session 32, call 1. Issue #6: ops.expert_ffn plans the tile layout from the routed pairs (`slot_tile_plan`: no
# sorted rows, no order scatter, no per-row group search, no composed combine index). GPU tests of the path, then
# the model's MoE path timed against session 31's sorted plan in the same run (bench/moe.py --ffn-from-tokens).
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 240 python3 -m pytest -x -q -m gpu tests/test_moe_kernels.py \
  -k "ops_run_prepared or tiled_expert_ffn or model_runs_its_mxfp4" 2>&1 | tail -4
mkdir -p $OUT/sub
OUT=$OUT/sub timeout 330 python3 bench/moe.py --no-ep --ffn-only --ffn-sizes routed --ffn-no-peers --ffn-rows 8,32,64 \
  --ffn-from-tokens 2>&1 | grep -E "MoE|tile layout [0-9]|copy|ERROR|rror" | cut -c1-300
