# Session 21, call 2: the MXFP4 expert FFN at 32 and 64 rows per expert (issue #6's bar covers groups up to 64 rows;
# sessions 18-19 measured 0.40 of copy at 32). A router's groups there are 32 ± 6 (max 43) and 64 ± 8: 32- / 64-row
# tiles give many experts a second tile (their weights streamed again); 48- / 96-row tiles hold every group in one.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 170 python3 -m pytest -q -x -m gpu tests/test_moe_kernels.py -k "tiled_expert_ffn_matches or cfg15" 2>&1 | tail -3
timeout 400 python3 bench/moe.py --no-ep --ffn-only --ffn-rows 32,64 --ffn-sizes routed --budget 380 --ffn-configs \
  '[{"rows":48},{"rows":48,"kh":128,"steps":3},{"rows":48,"ctas_per_sm":3},{"rows":96,"ctas_per_sm":1},{"rows":96,"kh":128,"steps":3,"ctas_per_sm":1},{"rows":80,"ctas_per_sm":1}]' \
  2>&1 | grep -E "FFN|copy band|budget" | cut -c1-420
