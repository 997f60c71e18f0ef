# Session 17, call 6: plan="tiles" reworked: x padded by a tile table in XLA (aligned R-row tiles: MMA N = R, no
# R + 8 fetch, so the registers of the XLA plan), the kernel storing each tile's rows in place (no output gather,
# no per-row plan in XLA). GPU tests; op at 8 rows (CTAs 4/5) and 32 rows: tiles vs kernel vs xla; ptx of tiles.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 200 python3 -m pytest -q -m gpu tests/test_moe_kernels.py -k "mgpu or prepared" --tb=short -p no:cacheprovider > $OUT/moe_tests.txt 2>&1
echo "moe mgpu tests rc=$?: $(grep -E '[0-9]+ (passed|failed)' $OUT/moe_tests.txt | tail -1)"
grep -E "^FAILED|^E  " $OUT/moe_tests.txt | head -12
timeout 200 python3 bench/moe.py --no-ep --mxfp4-only --q-rows 8 --budget 190 --q-configs '[]' --mgpu-configs '[{"plan": "tiles"}, {"plan": "tiles", "ctas_per_sm": 4}, {"ctas_per_sm": 4}, {"plan": "xla"}, {"plan": "tiles", "steps": 4, "ctas_per_sm": 4}]' 2>&1 | grep -E "MXFP4 .*rows|Error|copy" | sed -E 's/mma=.bf16., store=.rows., //' | cut -c1-300
timeout 200 python3 bench/moe.py --no-ep --mxfp4-only --q-rows 32,64 --budget 190 --q-configs '[]' --mgpu-configs '[{"plan": "tiles"}, {"plan": "xla"}]' 2>&1 | grep -E "MXFP4 .*rows|Error" | sed -E 's/mma=.bf16., store=.rows., //' | cut -c1-300
