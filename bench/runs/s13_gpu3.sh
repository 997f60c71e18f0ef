# Session 13, call 3: merge="last" (the sequence's last split to finish merges all partials in the kernel, through
# a per-sequence atomic counter) under a short timeout first; then every sparse_mgpu GPU test (the launch path
# changed for all configs), and whole-op timings against the Triton storage preset at B = 32, H = 12, ctx 32K.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 120 python3 -m pytest -x -q -m gpu tests/test_sparse_mgpu.py -k "last" > $OUT/first.txt 2>&1
echo "last tests rc=$?"; grep -E "passed|failed|Error|assert|mismatch" $OUT/first.txt | tail -8
grep -q " passed" $OUT/first.txt || exit 0
timeout 150 python3 -m pytest -q -m gpu tests/test_sparse_mgpu.py > $OUT/all.txt 2>&1
echo "all rc=$?"; grep -E "passed|failed|FAILED|Error" $OUT/all.txt | tail -8
timeout 360 python3 bench/mla_mgpu.py --ops kernel,op --configs '[{"warpgroups": 2, "splits": 4}, {"warpgroups": 2, "splits": 4, "merge": "last"}]' --op-configs '[{"warpgroups": 2, "splits": 4}, {"warpgroups": 2, "splits": 4, "merge": "last"}, {"merge": "last"}, {"splits": 8, "merge": "cluster"}]' 2>&1 | grep -vE "^\s*$|Warning|warn" | tail -14
