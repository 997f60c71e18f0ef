# Session 13, call 2: the cluster merge (merge="cluster": a sequence's splits as one thread-block cluster, merged
# (merge="cluster" was removed after this run; its code is in commit 43303f4.)
# through distributed shared memory) under a short timeout first; then its ptxas report, the op's parts (prepare_q,
# the merge kernel) and whole-op timings against the Triton storage preset at B = 32, H = 12, ctx 32K.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 120 python3 -m pytest -x -q -m gpu tests/test_sparse_mgpu.py -k "cluster" > $OUT/first.txt 2>&1
echo "cluster tests rc=$?"; grep -E "passed|failed|Error|assert|mismatch" $OUT/first.txt | tail -8
grep -q " passed" $OUT/first.txt || exit 0
c='{"warpgroups": 2, "splits": 4, "merge": "cluster"}'
mkdir -p /tmp/d; MOSAIC_GPU_DUMP_TO=/tmp/d MOSAIC_GPU_DUMP_PTXAS=1 timeout 60 python3 bench/runs/s12_mla_once.py "$c" > /tmp/d/log.txt 2>&1
echo "ptxas $c rc=$?: $(grep -rah -E 'Used [0-9]+ registers|spill stores' /tmp/d | sort -u | head -3 | tr '\n' ' ')"
timeout 330 python3 bench/mla_mgpu.py --ops parts,op --configs '[{}, {"warpgroups": 2, "splits": 4}, {"warpgroups": 2, "splits": 4, "merge": "cluster"}, {"splits": 8, "merge": "cluster"}, {"warpgroups": 2, "splits": 2, "merge": "cluster"}]' 2>&1 | grep -vE "^\s*$|Warning|warn" | tail -14
