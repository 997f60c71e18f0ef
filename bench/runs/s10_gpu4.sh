# Session 10, call 4: x's planes split with reduce_precision (XLA had folded the convert pair, lo was zero);
# the device tests and the MXFP4 sweep with both e4m3 decodes.
source bench/device_env.sh
timeout 60 python3 -c "
import sys; sys.path.insert(0,'bench')
import moe_fp8_check as m
m.planes_check()" 2>&1 | grep -v Warn | tail -3
JAX_PLATFORMS=cuda timeout 120 python3 -m pytest -q -m gpu tests/test_moe_kernels.py -k "mxfp4_decode_on_device" 2>&1 | tail -3
sed 's/dequant="fp8")/dequant="fp8_lut")/' bench/moe.py > bench/moe_lut_tmp.py
timeout 130 python3 bench/moe.py --sweep --no-ep --mxfp4-only --budget 120 2>&1 | grep -E "MXFP4 (8|32|64) |FAILED" | grep -E "fp8|asm_sign', bm_small=0\): 1" | cut -c12-250
timeout 90 python3 bench/moe_lut_tmp.py --sweep --no-ep --mxfp4-only --budget 80 2>&1 | grep -E "MXFP4 8 |FAILED" | grep -E "fp8" | cut -c12-250
rm -f bench/moe_lut_tmp.py
