# Session 20, call 3: GPU tests after sessions 19-20's model changes (vision, expert overlay, MoE layers on a mesh,
# cuDNN attention, the FFN's gate/up dtype): the kernel-path (model-level) file, MoE, KDA and vision.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 250 python3 -m pytest -q -m gpu tests/test_kernel_path.py --tb=short -p no:cacheprovider --durations=5 > $OUT/kernel_path.txt 2>&1
echo "kernel_path rc=$?"; grep -E "passed|failed|^E  |FAILED|s call" $OUT/kernel_path.txt | head -12
timeout 300 python3 -m pytest -q -m gpu tests/test_moe_kernels.py tests/test_kda_kernels.py tests/test_vision.py --tb=short -p no:cacheprovider > $OUT/kernels.txt 2>&1
echo "kernels rc=$?"; grep -E "passed|failed|^E  |FAILED" $OUT/kernels.txt | head -12
