# Session 14, call 3: the MoE Mosaic MXFP4 kernel after session 13's one-gather row prep: its GPU tests, then the
# MXFP4 decode section (Triton default vs the Mosaic kernel, 8 and 32 rows per expert).
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 150 python3 -m pytest -q -m gpu tests/test_moe_kernels.py -k mgpu --tb=short -p no:cacheprovider > $OUT/moe_tests.txt 2>&1
echo "moe mgpu tests rc=$?: $(grep -E '[0-9]+ (passed|failed)' $OUT/moe_tests.txt | tail -1)"
timeout 330 python3 bench/moe.py --no-ep --mxfp4-only --q-rows 8,32 --q-configs '[{}]' --mgpu-configs '[{}, {"rows": 8}]' 2>&1 | grep -vE "^\s*$|Warning|warn" | tail -16
