# Session 21, call 3: the MXFP4 expert FFN's tile shapes at 32 and 64 rows per expert, and the 8-row figure again.
# Call 2 found the larger tiles (48 / 80 rows: one tile per router-sized group) faster only at one CTA per SM or
# 128-byte steps; here smaller steps let 2-3 CTAs share an SM, so one CTA's decode overlaps another's MMAs (each
# CTA waits for its own MMAs every step). Per column block a CTA reads an x tile of rows × K bf16 from L2: rows/16
# times the weight block's bytes.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 150 python3 -m pytest -q -x -m gpu tests/test_moe_kernels.py -k "tiled_expert_ffn_matches or cfg15" 2>&1 | tail -2
B="python3 bench/moe.py --no-ep --ffn-only --ffn-sizes routed --ffn-no-peers"
F='MXFP4 FFN [0-9]+ rows/expert: tile|budget|copy band'
OUT=$OUT/r8 timeout 120 $B --ffn-rows 8 --ffn-bf16-gate-up --budget 100 2>&1 | grep -E "$F" | cut -c1-400
OUT=$OUT/r32 timeout 220 $B --ffn-rows 32 --budget 200 --ffn-configs \
  '[{"rows":48,"kh":128,"steps":2,"ctas_per_sm":3},{"rows":48,"kh":128,"steps":3,"ctas_per_sm":2},{"rows":48,"kh":64,"steps":4,"ctas_per_sm":3},{"rows":32,"kh":128,"steps":3,"ctas_per_sm":3},{"rows":40,"kh":128,"steps":3,"ctas_per_sm":2}]' \
  2>&1 | grep -E "$F" | cut -c1-400
OUT=$OUT/r64 timeout 220 $B --ffn-rows 64 --budget 200 --ffn-configs \
  '[{"rows":80,"kh":256,"steps":2,"ctas_per_sm":1},{"rows":80,"kh":128,"steps":2,"ctas_per_sm":2},{"rows":80,"kh":64,"steps":4,"ctas_per_sm":2},{"rows":64,"kh":128,"steps":2,"ctas_per_sm":2},{"rows":64,"kh":128,"steps":3,"ctas_per_sm":2}]' \
  2>&1 | grep -E "$F" | cut -c1-400
