# Session 14, call 6: the one-launch sparse MLA op with q prepared while the first gathers are in flight (it was
# prepared before they were issued): the in-kernel-prep GPU tests, then the op against the Triton preset.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 100 python3 -m pytest -q -m gpu tests/test_sparse_mgpu.py -k "kernel] or kernel-bf16 or kernel-fp8v or configs" --tb=short -p no:cacheprovider > $OUT/sparse_tests.txt 2>&1
echo "sparse mgpu tests rc=$?: $(grep -E '[0-9]+ (passed|failed)' $OUT/sparse_tests.txt | tail -1)"
grep -q failed $OUT/sparse_tests.txt && exit 0
timeout 150 python3 bench/mla_mgpu.py --ops kernel,op --configs '[{}]' 2>&1 | grep -vE "^\s*$|Warning|warn" | tail -4
