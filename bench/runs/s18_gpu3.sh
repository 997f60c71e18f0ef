# Session 18, call 3: the tile layout's config is now 16-row tiles, 256-byte steps, 2 stages, 3 CTAs per SM at <= 8
# rows per expert (call 2's best), and a loaded model re-lays its MXFP4 experts for the Mosaic kernel on a GPU
# (`MoE.use_mosaic_experts`). GPU tests (MoE kernels incl. the model-level one, then the kernel-path file), then the
# FFN bench at 8 rows per expert with router sizes and with equal sizes.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 200 python3 -m pytest -q -m gpu tests/test_moe_kernels.py -k "mgpu or prepared or tiled or model_runs" --tb=short -p no:cacheprovider > $OUT/moe_tests.txt 2>&1
echo "moe gpu tests rc=$?: $(grep -E '[0-9]+ (passed|failed)' $OUT/moe_tests.txt | tail -1)"
grep -E "^FAILED|^E  " $OUT/moe_tests.txt | head -12
timeout 120 python3 -m pytest -q -m gpu tests/test_kernel_path.py --tb=short -p no:cacheprovider > $OUT/kp_tests.txt 2>&1
echo "kernel-path gpu tests rc=$?: $(grep -E '[0-9]+ (passed|failed)' $OUT/kp_tests.txt | tail -1)"
grep -E "^FAILED|^E  " $OUT/kp_tests.txt | head -8
timeout 150 python3 bench/moe.py --no-ep --ffn-only --ffn-rows 8 --ffn-sizes routed --budget 140 2>&1 | grep -E "FFN|Error|FAILED|copy|tile layout" | cut -c1-400
timeout 130 python3 bench/moe.py --no-ep --ffn-only --ffn-rows 8 --ffn-sizes equal --budget 120 2>&1 | grep -E "FFN|Error|FAILED|tile layout" | cut -c1-400
