# Session 16, call 10: MgpuConfig(store="rows") — the kernel writes out [padded rows, N] (each thread stores its
# accumulator transposed into the staging tile), so the op's output gather reads whole rows instead of columns of
# outᵀ: GPU tests of the new store, then the op at 8 and 32 rows per expert, cols vs rows.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 150 python3 -m pytest -q -m gpu tests/test_moe_kernels.py -k "mgpu_mxfp4_matches and (cfg8 or cfg9 or cfg10)" --tb=line -p no:cacheprovider > $OUT/moe_tests.txt 2>&1
echo "moe mgpu tests rc=$?: $(grep -E '[0-9]+ (passed|failed)' $OUT/moe_tests.txt | tail -1)"
grep -E "^FAILED|assert|Error" $OUT/moe_tests.txt | head -8
grep -q "failed" $OUT/moe_tests.txt && exit 0
timeout 150 python3 bench/moe.py --no-ep --mxfp4-only --q-rows 8,32 --budget 140 --q-configs '[]' --mgpu-configs '[{}, {"store": "rows"}]' 2>&1 | grep -E "MXFP4 .*rows|Error" | cut -c1-260
