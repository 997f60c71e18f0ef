# Session 17, call 2: call 1's in-kernel plan was slower (kernel 260 vs 205 us at 8 rows/expert): per-row TMA
# stores and items as uneven as the groups. Now each thread stores its own accumulator elements (predicated global
# stores, no staging), and plan="tiles" gives even items (one R-row tile each, from a small XLA tile table). GPU
# tests, then the op at 8/32/64 rows per expert: plan kernel vs tiles vs xla.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 240 python3 -m pytest -q -m gpu tests/test_moe_kernels.py -k "mgpu or prepared" --tb=short -p no:cacheprovider > $OUT/moe_tests.txt 2>&1
echo "moe mgpu tests rc=$?: $(grep -E '[0-9]+ (passed|failed)' $OUT/moe_tests.txt | tail -1)"
grep -E "^FAILED|^E  " $OUT/moe_tests.txt | head -12
timeout 240 python3 bench/moe.py --no-ep --mxfp4-only --q-rows 8,32,64 --budget 230 --q-configs '[]' --mgpu-configs '[{}, {"plan": "tiles"}, {"plan": "xla"}]' 2>&1 | grep -E "MXFP4 .*rows|Error|copy" | sed -E 's/mma=.bf16., store=.rows., //' | cut -c1-300
