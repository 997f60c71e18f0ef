# Session 23, call 7: the 32-rows-per-expert FFN with down on four compute warpgroups of its own (`MgpuConfig.
# down_config`; call 6: a 40-row, 64-byte-step W = 4 matmul alone 289 us against 332 for W = 2, but the fused
# gate / up kernel at W = 4 slower). Device test of the tile-layout FFN first, then the defaults against the hybrid.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 80 python3 -m pytest -q -x -m gpu tests/test_moe_kernels.py -k "tiled_expert_ffn" 2>&1 | tail -2
D='"down_config":{"rows":40,"kh":64,"steps":6,"warpgroups":4,"ctas_per_sm":1,"plan":"xla"}'
mkdir -p $OUT/a
OUT=$OUT/a timeout 80 python3 bench/moe.py --no-ep --ffn-only --ffn-sizes routed --ffn-no-peers --ffn-rows 32 \
  --budget 75 --ffn-configs "[{$D},{$D}]" 2>&1 | grep -E 'MXFP4 FFN [0-9]+ rows/expert: tile|rror' | cut -c1-200
