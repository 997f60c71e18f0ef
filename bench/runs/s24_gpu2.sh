# Session 24 call 2: the vision tower's bucketed path after the position table moved to the device (call 1: 58 /
# 175 / 596 ms per image against the exact path's 15 / 26 / 105), and the FFN at a prefill's 146 rows per expert
# with tiled_config's new default (down alone at W = 4) against W = 2 down, after the device tests of the tile FFN.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 150 python3 bench/vision.py --path both --attention fused --sides 448,1000,1792 --reps 5 2>&1 | tail -8
timeout 100 python3 -m pytest -q -x -m gpu tests/test_moe_kernels.py -k "tiled_expert_ffn" 2>&1 | tail -2
mkdir -p $OUT/a
OUT=$OUT/a timeout 120 python3 bench/moe.py --no-ep --ffn-only --ffn-sizes routed --ffn-no-peers --ffn-rows 146 \
  --budget 115 --ffn-configs '[{"rows":80,"kh":128,"steps":4,"ctas_per_sm":1,"plan":"xla","warpgroups":2,"gate_up":"fused"}]' 2>&1 \
  | grep -E 'MXFP4 FFN [0-9]+ rows/expert: tile|rror' | cut -c1-150
