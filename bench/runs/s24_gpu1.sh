# Session 24 call 1: session 23's unrun s23_gpu7.sh (FFN with down at W = 4 via MgpuConfig.down_config, ± decode_pieces;
# device tests of the tile-layout FFN first), then the vision tower exact vs bucketed (engine path) per image side.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 100 python3 -m pytest -q -x -m gpu tests/test_moe_kernels.py -k "tiled_expert_ffn or warp_specialised_matches" 2>&1 | tail -2
B="python3 bench/moe.py --no-ep --ffn-only --ffn-sizes routed --ffn-no-peers"
F='MXFP4 FFN [0-9]+ rows/expert: tile|reference ready|rror'
W4='"kh":64,"steps":6,"warpgroups":4,"ctas_per_sm":1,"plan":"xla"'
mkdir -p $OUT/a $OUT/b
OUT=$OUT/a timeout 100 $B --ffn-rows 32 --budget 95 --ffn-configs \
  "[{\"down_config\":{\"rows\":40,$W4}},{\"down_config\":{\"rows\":40,$W4,\"decode_pieces\":true}}]" 2>&1 \
  | grep -E "$F" | cut -c1-200
OUT=$OUT/b timeout 150 $B --ffn-rows 64,146 --budget 145 --ffn-configs \
  "[{\"down_config\":{\"rows\":80,$W4}},{\"down_config\":{\"rows\":80,$W4,\"decode_pieces\":true}}]" 2>&1 \
  | grep -E "$F" | cut -c1-200
timeout 150 python3 bench/vision.py --path both --attention fused --sides 448,1000,1792 --reps 5 2>&1 | tail -12
