# Session 16, call 9: the placed decode with plain shifts (four of five left shifts as multiplies by 2^k: ptxas
# issues them as IMAD.SHL on the FMA pipe; ncu in call 8 showed math-pipe throttle with five ALU rotations): GPU
# tests, then 8 rows per expert at 4-6 CTAs per SM and the defaults at 32 and 64.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 150 python3 -m pytest -q -m gpu tests/test_moe_kernels.py -k "mgpu and (placed or large)" --tb=line -p no:cacheprovider > $OUT/moe_tests.txt 2>&1
echo "moe mgpu tests rc=$?: $(grep -E '[0-9]+ (passed|failed)' $OUT/moe_tests.txt | tail -1)"
grep -E "^FAILED|assert" $OUT/moe_tests.txt | head -8
grep -q "failed" $OUT/moe_tests.txt && exit 0
timeout 150 python3 bench/moe.py --no-ep --mxfp4-only --q-rows 8 --budget 140 --q-configs '[{}]' --mgpu-configs '[{}, {"ctas_per_sm": 5}, {"ctas_per_sm": 5, "steps": 2}, {"ctas_per_sm": 6, "steps": 2}]' 2>&1 | grep -E "MXFP4 .*rows|Error" | sed -E 's/, row prep.*//' | cut -c1-230
timeout 150 python3 bench/moe.py --no-ep --mxfp4-only --q-rows 32,64 --budget 140 --q-configs '[{}]' --mgpu-configs '[{}, {"ctas_per_sm": 3}]' 2>&1 | grep -E "MXFP4 .*rows|Error" | sed -E 's/, row prep.*//' | cut -c1-230
