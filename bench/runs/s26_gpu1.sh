# Session 26 call 1 (issue #6): gate / up prepared with their output columns in the down matmul's x-plane order
# (`mgpu_mxfp4.prepare_ffn_weights`, what a model now prepares), so the fused kernel writes h as down's planes and
# the XLA transpose between the kernels (36 us of 962 at 32 rows per expert, ncu session 23) is gone. First the
# device tests of the tile FFN (both orders, every config) and the model-level Mosaic-expert test, then the FFN at
# 8 / 32 / 64 rows per expert with gate / up in plane order and in natural order, one after the other.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
mkdir -p $OUT/sub
timeout 200 python3 -m pytest -q -x -m gpu tests/test_moe_kernels.py \
  -k "tiled_expert_ffn or model_runs_its_mxfp4 or warp_specialised_matches" 2>&1 | tail -3
OUT=$OUT/sub timeout 330 python3 bench/moe.py --no-ep --ffn-only --ffn-sizes routed --ffn-no-peers --ffn-rows 32,64,8 \
  --ffn-gate-up-order planes,natural --budget 320 2>&1 \
  | grep -E 'MXFP4 FFN [0-9]+ rows/expert: tile|copy band|rror' | cut -c1-330
