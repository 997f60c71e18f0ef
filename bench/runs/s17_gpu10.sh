# Session 17, call 10: the in-kernel plan's direct store builds its thread indices on an opaque %tid.x read, so LLVM
# cannot hoist the per-element addresses and predicates above the pipeline (call 9: 35 registers live across it vs
# 13). GPU tests of the in-kernel plan, its PTX (ptxas -v here), then the op at 8 rows per expert, 4 and 5 CTAs/SM.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 150 python3 -m pytest -q -m gpu tests/test_moe_kernels.py -k "edges or cfg12 or cfg13 or cfg14 or prepared or large" --tb=short -p no:cacheprovider > $OUT/moe_tests.txt 2>&1
echo "moe gpu tests rc=$?: $(grep -E '[0-9]+ (passed|failed)' $OUT/moe_tests.txt | tail -1)"
grep -E "^FAILED|^E  " $OUT/moe_tests.txt | head -12
grep -q " failed" $OUT/moe_tests.txt && exit 0
timeout 100 python3 bench/runs/s17_ptx_probe.py $OUT/ptx 2>&1 | grep -E "ok$" | tr '\n' ' '; echo
find $OUT/ptx -type f ! -name "*.ptx" -delete; rm -rf $OUT/ptx/xla8 $OUT/ptx/xla16
timeout 150 python3 bench/moe.py --no-ep --mxfp4-only --q-rows 8 --budget 140 --q-configs '[]' --mgpu-configs '[{}, {"ctas_per_sm": 5}, {"plan": "xla", "ctas_per_sm": 5}]' 2>&1 | grep -E "MXFP4 .*rows|Error|copy" | sed -E 's/mma=.bf16., store=.rows., //' | cut -c1-300
