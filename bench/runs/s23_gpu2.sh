# Session 23, call 2: tile sizes around the warp-specialised defaults (gate / up / SiTU fused, h in bf16).
# 146 rows per expert (a 16K-token prefill; call 1: 80-row tiles 2733 us, now tiled_config's default there),
# 72 / 96 / 112-row tiles and 80 with 6 stages of 64-byte steps; 32 rows (default 40-row tiles) against 32 / 48;
# 64 rows (default 80) against 72 / 96.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
B="python3 bench/moe.py --no-ep --ffn-only --ffn-sizes routed --ffn-no-peers"
F='MXFP4 FFN [0-9]+ rows/expert: tile|copy band|reference ready|rror'
W='"warpgroups":2,"ctas_per_sm":1,"gate_up":"fused","kh":128,"steps":4'
mkdir -p $OUT/pre $OUT/dec
OUT=$OUT/pre timeout 200 $B --ffn-rows 146 --budget 190 --ffn-configs \
  "[{$W,\"rows\":72},{$W,\"rows\":96},{$W,\"rows\":112},{$W,\"rows\":80,\"kh\":64,\"steps\":6}]" \
  2>&1 | grep -E "$F" | cut -c1-300
OUT=$OUT/dec timeout 200 $B --ffn-rows 32,64 --budget 190 --ffn-configs \
  "[{$W,\"rows\":32},{$W,\"rows\":48},{$W,\"rows\":72},{$W,\"rows\":96}]" \
  2>&1 | grep -E "$F" | cut -c1-300
