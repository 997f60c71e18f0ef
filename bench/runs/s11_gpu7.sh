# Session 11, call 7: the Mosaic GPU kernel's fp8 path (codes shifted into e4m3, one wgmma pair per 32-element group
# into its own accumulator, scaled and folded after each step): GPU tests, then timing at 8 and 32 rows.
source bench/device_env.sh
JAX_PLATFORMS=cuda timeout 220 python3 -m pytest -q -m gpu tests/test_moe_kernels.py -k mgpu 2>&1 | grep -E "passed|failed|Error|assert" | tail -12
timeout 300 python3 bench/moe.py --no-ep --mxfp4-only --q-rows 8,32 --budget 280 --q-configs '[{}]' --mgpu-configs '[{}, {"mma": "fp8", "rows": 8}, {"mma": "fp8", "rows": 8, "kh": 64}, {"mma": "fp8", "rows": 8, "ctas_per_sm": 3, "steps": 3}, {"mma": "fp8", "rows": 8, "kh": 256, "steps": 3}, {"mma": "fp8"}, {"mma": "fp8", "ctas_per_sm": 1, "steps": 6}]' 2>&1 | grep -E "MXFP4 |FAIL|Error" | cut -c1-300
