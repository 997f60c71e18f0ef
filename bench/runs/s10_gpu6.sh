# Session 10, call 6: device tests after the fp8 MoE path (fp8_dot_nt now takes an accumulator: the indexer's fp8
# dots re-checked) and the 512-wide MXFP4 default at 8 rows; the default timed once more.
source bench/device_env.sh
JAX_PLATFORMS=cuda timeout 300 python3 -m pytest -q -m gpu tests/test_moe_kernels.py tests/test_dsa_kernels.py -k "mxfp4 or fp8_dots or storage or grouped" 2>&1 | tail -3
timeout 150 python3 bench/moe.py --no-ep --mxfp4-only --budget 140 2>&1 | grep -E "MXFP4 8 |vs copy \(8" | cut -c1-250
