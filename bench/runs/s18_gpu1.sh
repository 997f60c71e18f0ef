# Session 18, call 1: the tile-layout MXFP4 expert FFN (`mgpu_mxfp4.expert_ffn_tiled`: rows padded once for gate, up
# and down). First the Mosaic MXFP4 GPU tests (they also check session 17's last two commits, run on CPU only), then
# bench/moe.py's FFN section at 8 and 32 rows per expert, then the sorted-rows op at 8 rows (both plans) in the
# same call for comparison.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 240 python3 -m pytest -q -m gpu tests/test_moe_kernels.py -k "mgpu or prepared or tiled" --tb=short -p no:cacheprovider > $OUT/moe_tests.txt 2>&1
echo "moe mgpu tests rc=$?: $(grep -E '[0-9]+ (passed|failed)' $OUT/moe_tests.txt | tail -1)"
grep -E "^FAILED|^E  " $OUT/moe_tests.txt | head -12
timeout 200 python3 bench/moe.py --no-ep --ffn-only --ffn-rows 8,32 --budget 190 2>&1 | grep -E "FFN|Error|FAILED|copy|tile layout" | cut -c1-400
timeout 110 python3 bench/moe.py --no-ep --mxfp4-only --ffn-rows "" --q-rows 8 --budget 100 --q-configs '[]' --mgpu-configs '[{}, {"plan": "xla", "ctas_per_sm": 5}]' 2>&1 | grep -E "MXFP4 .*rows|Error|copy" | sed -E 's/mma=.bf16., store=.rows., //' | cut -c1-300
