# Session 17, call 7: plan="kernel" tiles now take as many of a group's rows as their R + 8 fetched rows hold
# (fewer tiles, so fewer passes over each expert's weights: at 8 rows per expert Σ ceil(size / 8) ≈ 1.5 passes per
# expert). GPU tests of the in-kernel plans; op at 8 rows (CTAs 4 and 3) and 32 rows vs the XLA plan.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 200 python3 -m pytest -q -m gpu tests/test_moe_kernels.py -k "mgpu_mxfp4_matches or edges or prepared or large" --tb=short -p no:cacheprovider > $OUT/moe_tests.txt 2>&1
echo "moe mgpu tests rc=$?: $(grep -E '[0-9]+ (passed|failed)' $OUT/moe_tests.txt | tail -1)"
grep -E "^FAILED|^E  " $OUT/moe_tests.txt | head -12
timeout 200 python3 bench/moe.py --no-ep --mxfp4-only --q-rows 8,32 --budget 190 --q-configs '[]' --mgpu-configs '[{"ctas_per_sm": 4}, {"ctas_per_sm": 3}, {"plan": "xla"}]' 2>&1 | grep -E "MXFP4 .*rows|Error|copy" | sed -E 's/mma=.bf16., store=.rows., //' | cut -c1-300
