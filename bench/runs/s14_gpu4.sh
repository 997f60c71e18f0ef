# Session 14, call 4: the MoE Mosaic MXFP4 op with its rows as a row gather + a static transpose (call 3: the
# session-13 element gather cost 100–355 µs), and the XLA on each side of the kernel timed alone.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 100 python3 -m pytest -q -m gpu tests/test_moe_kernels.py -k mgpu --tb=short -p no:cacheprovider > $OUT/moe_tests.txt 2>&1
echo "moe mgpu tests rc=$?: $(grep -E '[0-9]+ (passed|failed)' $OUT/moe_tests.txt | tail -1)"
timeout 200 python3 bench/moe.py --no-ep --mxfp4-only --q-rows 8,32 --q-configs '[{}]' --mgpu-configs '[{}]' 2>&1 | grep -E "MXFP4 .*rows|FAIL|Error" | tail -8
