# Session 20, call 1: the first GPU runs of cuDNN attention in the vision tower and of bf16 gate / up outputs in
# the MXFP4 FFN's tile layout (tests, then benches timing old and new in the same run), and the random-row gather
# ceiling for issue #5 measured with torch (bench/gather_ceiling.py).
source bench/device_env.sh
export JAX_PLATFORMS=cuda
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv
timeout 170 python3 -m pytest -q -m gpu tests/test_vision.py tests/test_moe_kernels.py -k "fused_attention or tiled" \
  --tb=short -p no:cacheprovider > $OUT/tests.txt 2>&1
echo "tests rc=$?"; grep -E "passed|failed|^E  |FAILED|Error" $OUT/tests.txt | head -20
timeout 100 python3 bench/gather_ceiling.py --json $OUT/gather_ceiling.json 2>&1 | tail -16
timeout 130 python3 bench/vision.py --sides 448,896,1792 --reps 3 2>&1 | grep -v Warning | tail -9
timeout 170 python3 bench/moe.py --no-ep --ffn-only --ffn-rows 8 --ffn-sizes routed --budget 150 > $OUT/moe.txt 2>&1
echo "moe rc=$?"; grep -E "FFN|copy|bandwidth|FAIL|pass|Error" $OUT/moe.txt | tail -14
