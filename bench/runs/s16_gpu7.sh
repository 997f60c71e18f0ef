# Session 16, call 7: MgpuConfig(overlap=True) — a step's MMAs left running while the next step decodes
# (wgmma_wait(1), x released a step late through delay_release): GPU tests first (wrong results / NaNs were seen
# in session 11 with a hand-made version), then timings against the plain kernel at 8, 32 and 64 rows per expert.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 200 python3 -m pytest -q -m gpu tests/test_moe_kernels.py -k "mgpu_mxfp4_matches" --tb=line -p no:cacheprovider > $OUT/moe_tests.txt 2>&1
echo "moe mgpu tests rc=$?: $(grep -E '[0-9]+ (passed|failed)' $OUT/moe_tests.txt | tail -1)"
grep -E "^FAILED|^/.*Error|assert" $OUT/moe_tests.txt | head -12
grep -q "failed" $OUT/moe_tests.txt && exit 0
timeout 330 python3 bench/moe.py --no-ep --mxfp4-only --q-rows 8,32,64 --budget 320 --q-configs '[]' --mgpu-configs '[{"ctas_per_sm": 4}, {"overlap": true}, {"overlap": true, "ctas_per_sm": 2}, {"overlap": true, "kh": 256, "steps": 2}, {"overlap": true, "ctas_per_sm": 4}]' 2>&1 | grep -E "MXFP4 .*rows|Error" | sed -E 's/row prep.*//' | tail -20
