# Written in session 23 after its device time ran out (not yet run). The FFN with down on four compute warpgroups
# of its own (`MgpuConfig.down_config`; session 23 call 6: a 40-row, 64-byte-step W = 4 matmul alone 289 us against
# 332 at W = 2, but the fused gate / up kernel at W = 4 slower). Device test of the tile-layout FFN first (it holds a
# down_config case), then per row count the default against down at W = 4, with and without decode_pieces.
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
