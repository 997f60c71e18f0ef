# Session 10, call 1: MXFP4 codes on fp8 tensor cores (dequant="fp8") — device tests, then the MXFP4 sweep.
source bench/device_env.sh
JAX_PLATFORMS=cuda timeout 240 python3 -m pytest -q -m gpu tests/test_moe_kernels.py -k "mxfp4_decode_on_device" 2>&1 | tail -15
timeout 300 python3 bench/moe.py --sweep --no-ep --mxfp4-only --budget 280 2>&1 | grep -E "MXFP4|TB/s|versions|copy|FAIL|pass|Error|error" | cut -c1-400
