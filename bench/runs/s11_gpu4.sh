# Session 11, call 4: first device run of the Mosaic GPU MXFP4 kernel (pallas_kernels/moe/mgpu_mxfp4.py): its GPU
# tests, then timing at 8 and 32 rows per expert next to the Triton default.
source bench/device_env.sh
JAX_PLATFORMS=cuda timeout 240 python3 -m pytest -q -m gpu tests/test_moe_kernels.py -k mgpu -x 2>&1 | grep -v Deprecat | tail -25
timeout 300 python3 bench/moe.py --no-ep --mxfp4-only --q-rows 8,32 --budget 280 --q-configs '[{}]' --mgpu-configs '[{}, {"kh": 256}, {"n_blocks": 2}, {"ctas_per_sm": 1, "steps": 6}, {"ctas_per_sm": 3, "steps": 3}, {"kh": 256, "ctas_per_sm": 1}]' 2>&1 | grep -E "MXFP4 |copy bandwidth|FAIL|Error" | cut -c1-300
