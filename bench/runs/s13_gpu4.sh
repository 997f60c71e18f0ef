# Session 13, call 4: merge="last" with the merging CTA's loads batched (every head's partials issued before any
# arithmetic): its GPU tests, then kernel-alone and whole-op timings against the plain kernel + merge launch.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 90 python3 -m pytest -x -q -m gpu tests/test_sparse_mgpu.py -k "last" > $OUT/first.txt 2>&1
echo "last tests rc=$?"; grep -E "passed|failed|Error|assert|mismatch" $OUT/first.txt | tail -8
grep -q " passed" $OUT/first.txt || exit 0
timeout 200 python3 bench/mla_mgpu.py --ops kernel,op --no-triton --configs '[{"warpgroups": 2, "splits": 4}, {"warpgroups": 2, "splits": 4, "merge": "last"}]' 2>&1 | grep -vE "^\s*$|Warning|warn" | tail -8
