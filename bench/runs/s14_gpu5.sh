# Session 14, call 5: sparse MLA's new default (prep="kernel", merge="last": one launch) through every GPU test,
# the op timed against the session-13 two-launch op; then the MoE MXFP4 op's XLA pieces (no kernel) one by one.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 120 python3 -m pytest -q -m gpu tests/test_sparse_mgpu.py --tb=short -p no:cacheprovider > $OUT/sparse_tests.txt 2>&1
echo "sparse mgpu tests rc=$?: $(grep -E '[0-9]+ (passed|failed)' $OUT/sparse_tests.txt | tail -1)"
timeout 120 python3 bench/runs/s14_moe_xla.py 2>&1 | grep -vE "^\s*$|Warning|warn"
timeout 200 python3 bench/mla_mgpu.py --ops op --configs '[{}, {"prep": "xla", "merge": "kernel"}]' 2>&1 | grep -vE "^\s*$|Warning|warn" | tail -5
