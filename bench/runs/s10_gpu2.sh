# Session 10, call 2: where the fp8 path's 2.4% error comes from (subnormal e4m3 weights?), then the LUT decode timed.
source bench/device_env.sh
timeout 150 python3 bench/moe_fp8_check.py 2>&1 | grep -v Warning | tail -12
python3 - <<'PY'
import re
src = open("bench/moe.py").read()
src = src.replace('dequant="fp8")', 'dequant="fp8_lut")')
open("/tmp/moe_lut.py", "w").write(src)
PY
cp /tmp/moe_lut.py bench/moe_lut_tmp.py
timeout 200 python3 bench/moe_lut_tmp.py --sweep --no-ep --mxfp4-only --budget 170 2>&1 | grep -E "MXFP4 8 |FAILED" | grep -E "fp8|asm_sign', bm_small=0\): 1" | cut -c1-260
rm -f bench/moe_lut_tmp.py
