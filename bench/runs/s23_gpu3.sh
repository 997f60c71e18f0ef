# Session 23, call 3: `MgpuConfig(mma_wait="step")` — each 64-byte piece of a step's codes decoded and its MMAs
# issued at once, one wait per step, so a piece's decode overlaps the previous pieces' MMAs (in the fused kernel
# also up's decode over gate's MMAs). Device tests first (the WS kernel and the tile-layout FFN with it), then the
# FFN at 8 / 32 / 64 / 146 rows per expert, the defaults against the same with mma_wait="step".
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 200 python3 -m pytest -q -x -m gpu tests/test_moe_kernels.py -k "warp_specialised or tiled_expert_ffn" 2>&1 | tail -3
B="python3 bench/moe.py --no-ep --ffn-only --ffn-sizes routed --ffn-no-peers"
F='MXFP4 FFN [0-9]+ rows/expert: tile|copy band|reference ready|rror'
mkdir -p $OUT/a $OUT/b
OUT=$OUT/a timeout 200 $B --ffn-rows 32,8 --budget 190 --ffn-configs '[{"mma_wait":"step"}]' 2>&1 \
  | grep -E "$F" | cut -c1-330
OUT=$OUT/b timeout 170 $B --ffn-rows 64,146 --budget 160 --ffn-configs '[{"mma_wait":"step"}]' 2>&1 \
  | grep -E "$F" | cut -c1-330
