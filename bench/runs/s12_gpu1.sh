# Session 12, call 1: the new Mosaic GPU sparse MLA kernel (pallas_kernels/mla/sparse_mgpu.py) — first device run:
# one small case under a short timeout (a wrong mbarrier protocol hangs), then the other GPU tests, then timing.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 120 python3 -m pytest -x -q -m gpu tests/test_sparse_mgpu.py -k "matches_reference and 12-2048" > $OUT/first.txt 2>&1
echo "first rc=$?"; tail -30 $OUT/first.txt
grep -q " passed" $OUT/first.txt || exit 0
timeout 150 python3 -m pytest -q -m gpu tests/test_sparse_mgpu.py 2>&1 | grep -E "passed|failed|Error|assert|rel_rms" | tail -15
timeout 200 python3 bench/mla_mgpu.py --configs '[{}, {"splits": 4}, {"stages": 3}, {"splits": 4, "stages": 4}]' 2>&1 | grep -vE "^\s*$" | tail -20
