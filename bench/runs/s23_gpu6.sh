# Session 23, call 6: W = 4 compute warpgroups with a register split the CTA's pool can hold (104 per compute
# thread: `ws_compute_registers`; JAX's own split asked 4 x 112 + 40 of 480 and hung in session 22). Its device test
# first (short timeout: a hang must not eat the call), then the FFN at 32 and 64 rows per expert, defaults against
# W = 4 (64-byte steps: 32 A registers per weight; fused at 40 rows: 2 x 20 accumulator registers).
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 90 python3 -m pytest -q -x -m gpu tests/test_moe_kernels.py -k "warp_specialised_matches and cfg5" 2>&1 | tail -2
B="python3 bench/moe.py --no-ep --ffn-only --ffn-sizes routed --ffn-no-peers"
F='MXFP4 FFN [0-9]+ rows/expert: tile|copy band|reference ready|rror'
W='"warpgroups":4,"ctas_per_sm":1'
mkdir -p $OUT/a
OUT=$OUT/a timeout 150 $B --ffn-rows 32,64 --budget 140 --ffn-configs \
  "[{$W,\"rows\":40,\"kh\":64,\"steps\":6,\"gate_up\":\"fused\"},{$W,\"rows\":80,\"kh\":64,\"steps\":4,\"gate_up\":\"separate\"}]" \
  2>&1 | grep -E "$F" | cut -c1-330
