# Session 22, third call: the 64-row default is now the warp-specialised kernel (W = 2, 80-row tiles, 128-byte
# steps); the W = 2 kernel also runs gate, up and SiTU as one kernel (gate_up="fused"). Device tests first (the
# warp-specialised kernel at 80 rows, the tile-layout FFN with both new configs), then the FFN at 64 and 32 rows per
# expert: default vs fused vs the previous default, and gate / up written bf16 beside each (--ffn-bf16-gate-up).
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 170 python3 -m pytest -q -x -m gpu tests/test_moe_kernels.py -k "warp_specialised or tiled_expert_ffn" 2>&1 | tail -3
B="python3 bench/moe.py --no-ep --ffn-only --ffn-sizes routed --ffn-no-peers --ffn-bf16-gate-up"
F='MXFP4 FFN [0-9]+ rows/expert: tile|budget|copy band|reference ready|rror'
W='"warpgroups":2,"ctas_per_sm":1,"kh":128,"steps":4'
mkdir -p $OUT/r64 $OUT/r32
OUT=$OUT/r64 timeout 190 $B --ffn-rows 64 --budget 180 --ffn-configs \
  '[{"gate_up":"fused"},{"warpgroups":1,"kh":256,"steps":2}]' 2>&1 | grep -E "$F" | cut -c1-420
OUT=$OUT/r32 timeout 190 $B --ffn-rows 32 --budget 180 --ffn-configs \
  "[{$W},{$W,\"gate_up\":\"fused\"}]" 2>&1 | grep -E "$F" | cut -c1-420
