# Session 11, call 10: every MoE GPU test after the review's refactor of the Mosaic GPU kernel (shared work-item loop,
# epilogue and launch) and the shared MXFP4 device case; the default Mosaic shapes timed once.
source bench/device_env.sh
JAX_PLATFORMS=cuda timeout 300 python3 -m pytest -q -m gpu tests/test_moe_kernels.py 2>&1 | grep -E "passed|failed|Error|assert" | tail -8
timeout 150 python3 bench/moe.py --no-ep --mxfp4-only --q-rows 8,32 --budget 130 --q-configs '[{}]' --mgpu-configs '[{}]' 2>&1 | grep -E "MXFP4 |FAIL|Error" | cut -c1-300
