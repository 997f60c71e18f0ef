# Session 23, call 4: `MgpuConfig(decode_pieces=True)` — each weight's step decoded in 64-byte pieces, each piece's
# MMAs issued at once, one wait per weight (call 3's one wait per step made the fused kernel slower; one weight's
# kernel gained 3-5%). Device tests, then the FFN at 32 / 64 / 146 rows per expert, default against decode_pieces.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 200 python3 -m pytest -q -x -m gpu tests/test_moe_kernels.py -k "warp_specialised or tiled_expert_ffn" 2>&1 | tail -3
B="python3 bench/moe.py --no-ep --ffn-only --ffn-sizes routed --ffn-no-peers"
F='MXFP4 FFN [0-9]+ rows/expert: tile|copy band|reference ready|rror'
mkdir -p $OUT/a
OUT=$OUT/a timeout 240 $B --ffn-rows 32,64,146 --budget 230 --ffn-configs '[{"decode_pieces":true}]' 2>&1 \
  | grep -E "$F" | cut -c1-330
