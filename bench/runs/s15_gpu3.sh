# Session 15, call 3: the sparse kernel with the LSU gather (gather="lsu": 16-byte cp.async chunks, the probe's
# fastest) through its GPU tests, then the whole op, tma vs lsu, at B = 32 and 8 beside the Triton storage preset
# (B = 8: where the dispatch's small-batch boundary sits).
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 180 python3 -m pytest -q -m gpu tests/test_sparse_mgpu.py -k "lsu" --tb=short -p no:cacheprovider > $OUT/lsu_tests.txt 2>&1
echo "lsu tests rc=$?: $(grep -E '[0-9]+ (passed|failed)' $OUT/lsu_tests.txt | tail -1)"
grep -q " passed" $OUT/lsu_tests.txt && ! grep -q failed $OUT/lsu_tests.txt && C='[{}, {"gather": "lsu"}]' || C='[{}]'
timeout 300 python3 bench/mla_mgpu.py --ops op --batches 32,8 --configs "$C" 2>&1 | grep -vE "^\s*$|Warning|warn" | tail -8
