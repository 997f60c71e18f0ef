# Session 17, call 8: the final code — plan="kernel" (tiles taking up to R + 8 rows) is the default at <= 8 rows per
# expert (4 CTAs per SM), plan="xla" above; "tiles" removed. All MoE GPU tests, then the bench with the defaults.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 300 python3 -m pytest -q -m gpu tests/test_moe_kernels.py --tb=short -p no:cacheprovider > $OUT/moe_tests.txt 2>&1
echo "moe gpu tests rc=$?: $(grep -E '[0-9]+ (passed|failed)' $OUT/moe_tests.txt | tail -1)"
grep -E "^FAILED|^E  " $OUT/moe_tests.txt | head -12
timeout 200 python3 bench/moe.py --no-ep --mxfp4-only --q-rows 8,32,64 --budget 190 --q-configs '[{}]' --mgpu-configs '[{}, {"plan": "xla", "ctas_per_sm": 5}]' 2>&1 | grep -E "MXFP4 .*rows|Error|copy" | sed -E 's/mma=.bf16., store=.rows., //' | cut -c1-300
