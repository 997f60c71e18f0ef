# Session 16, call 1 (and 5, after fixing the decode choice: a local `layout` shadowed the parameter): the Mosaic MXFP4 kernel with the table-free "placed" decode (mxfp4.DECODE_PTX_PLACED, 15
# instead of 20 instructions per 8 weights): its GPU tests (both layouts, large / zero scales), then the MXFP4
# decode section at 8, 32 and 64 rows per expert: Triton default, Mosaic placed vs natural.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 200 python3 -m pytest -q -m gpu tests/test_moe_kernels.py -k "mgpu" --tb=short -p no:cacheprovider > $OUT/moe_tests.txt 2>&1
echo "moe mgpu tests rc=$?: $(grep -E '[0-9]+ (passed|failed)' $OUT/moe_tests.txt | tail -1)"
grep -E "^FAILED|Error|assert" $OUT/moe_tests.txt | head -12
timeout 330 python3 bench/moe.py --no-ep --mxfp4-only --q-rows 8,32,64 --budget 320 --q-configs '[{}]' --mgpu-configs '[{}, {"layout": "natural"}]' 2>&1 | grep -E "MXFP4 .*rows|FAIL|Error|copy" | tail -14
