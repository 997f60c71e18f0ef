# Session 17, call 1: the Mosaic MXFP4 op with its group plan inside the kernel (MgpuConfig.plan="kernel": items
# (expert, column block), x rows fetched by offset, output rows stored in place; no padding, no gathers): GPU tests
# (incl. session 16's unrun test_gpu_ops_run_prepared_weights_on_the_mosaic_kernel), then the op at 8/32/64 rows
# per expert, kernel plan vs the XLA plan, then ncu's per-kernel GPU time of the op at 8 rows.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 240 python3 -m pytest -q -m gpu tests/test_moe_kernels.py -k "mgpu or prepared" --tb=short -p no:cacheprovider > $OUT/moe_tests.txt 2>&1
echo "moe mgpu tests rc=$?: $(grep -E '[0-9]+ (passed|failed)' $OUT/moe_tests.txt | tail -1)"
grep -E "^FAILED|^E  " $OUT/moe_tests.txt | head -12
timeout 200 python3 bench/moe.py --no-ep --mxfp4-only --q-rows 8,32,64 --budget 190 --q-configs '[]' --mgpu-configs '[{}, {"plan": "xla"}]' 2>&1 | grep -E "MXFP4 .*rows|Error|copy" | cut -c1-300
timeout 100 /usr/local/cuda/bin/ncu --clock-control none --metrics gpu__time_duration.sum --print-summary per-kernel python3 bench/runs/s16_moe_kernels.py > $OUT/ncu.txt 2>&1
echo "ncu rc=$?"; grep -E "^  [a-zA-Z_].*\(|gpu__time_duration.sum" $OUT/ncu.txt | paste - - | awk '{print $1, $(NF-1), $NF}' | head -20
