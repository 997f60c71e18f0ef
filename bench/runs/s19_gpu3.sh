# Session 19, call 3: call 2's kernel-path file hit its 140 s limit with no test finished (compile time); alone,
# verbose, with more time.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 330 python3 -m pytest -v -m gpu tests/test_kernel_path.py --tb=short -p no:cacheprovider --durations=5 > $OUT/kernel_path.txt 2>&1
echo "kernel_path rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed|^E  |s call|s setup" $OUT/kernel_path.txt | head -20
