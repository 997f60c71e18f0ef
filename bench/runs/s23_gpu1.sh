# Next GPU run (written in session 22, not yet run). (1) Device tests of the warp-specialised MXFP4 kernel and the
# tile-layout FFN, now with the fused gate / up kernel writing h in bf16. (2) The FFN at 8, 64 and 32 rows per expert
# with the defaults (session 22 with h in fp32: 664, 1413 and 969 us), and with down storing its rows in place
# (`MgpuConfig(down_rows="in_place")`: no padded down output, no gather back; written in session 22, untimed).
# (3) A 16K-token prefill's load, 146 rows per expert (session 19: 4015 us, compute-bound at 270 TFLOP/s, one
# warpgroup per CTA), against the warp-specialised kernel: 80-row tiles fused (the 64-row default), 128-row tiles
# separate and fused.
# The reference FFN no longer embeds the weights as constants: setup should be ~20 s per row count, not 100-146.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 170 python3 -m pytest -q -x -m gpu tests/test_moe_kernels.py -k "warp_specialised or tiled_expert_ffn" 2>&1 | tail -3
B="python3 bench/moe.py --no-ep --ffn-only --ffn-sizes routed --ffn-no-peers"
F='MXFP4 FFN [0-9]+ rows/expert: tile|budget|copy band|reference ready|rror'
W='"warpgroups":2,"ctas_per_sm":1'
mkdir -p $OUT/dec $OUT/pre
OUT=$OUT/dec timeout 200 $B --ffn-rows 8,64,32 --budget 190 --ffn-configs '[{"down_rows":"in_place"}]' 2>&1 \
  | grep -E "$F" | cut -c1-420
OUT=$OUT/pre timeout 220 $B --ffn-rows 146 --budget 210 --ffn-configs \
  "[{$W,\"rows\":80,\"kh\":128,\"steps\":4,\"gate_up\":\"fused\"},{$W,\"rows\":128,\"kh\":64,\"steps\":4},{$W,\"rows\":128,\"kh\":64,\"steps\":3,\"gate_up\":\"fused\"}]" \
  2>&1 | grep -E "$F" | cut -c1-420
