# Session 17, call 11: after sharing the K loop between the two bf16 kernels (`_bf16_decode`, `_mma_over_k`; no
# intended change): the Mosaic MXFP4 GPU tests, and the op at 8 rows per expert, both plans.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 200 python3 -m pytest -q -m gpu tests/test_moe_kernels.py -k "mgpu or prepared" --tb=short -p no:cacheprovider > $OUT/moe_tests.txt 2>&1
echo "moe mgpu tests rc=$?: $(grep -E '[0-9]+ (passed|failed)' $OUT/moe_tests.txt | tail -1)"
grep -E "^FAILED|^E  " $OUT/moe_tests.txt | head -12
grep -q " failed" $OUT/moe_tests.txt && exit 0
timeout 90 python3 bench/moe.py --no-ep --mxfp4-only --q-rows 8 --budget 80 --q-configs '[]' --mgpu-configs '[{}, {"plan": "xla", "ctas_per_sm": 5}]' 2>&1 | grep -E "MXFP4 .*rows|Error|copy" | sed -E 's/mma=.bf16., store=.rows., //' | cut -c1-300
