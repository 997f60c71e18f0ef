# Session 12, call 4: sparse_mgpu v2 (conflict-free loads, block-table lookup in the kernel, natural-order o + Pallas
# merge): GPU tests, then kernel-alone / XLA-side / op timings, then ncu of the default config.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 100 python3 -m pytest -x -q -m gpu tests/test_sparse_mgpu.py -k "matches_reference and 12-2048" > $OUT/first.txt 2>&1
echo "first rc=$?"; tail -5 $OUT/first.txt
grep -q " passed" $OUT/first.txt || exit 0
timeout 120 python3 -m pytest -q -m gpu tests/test_sparse_mgpu.py 2>&1 | grep -E "passed|failed|Error|assert|rel_rms" | tail -8
timeout 260 python3 bench/mla_mgpu.py --ops kernel,parts,op --configs '[{}, {"value_keys": 64}, {"value_keys": 16}, {"splits": 4, "stages": 3}, {"splits": 16}]' 2>&1 | grep -vE "^\s*$|Warning|warn" | tail -16
NCU=/usr/local/cuda/bin/ncu
timeout 150 $NCU --clock-control none -k regex:sparse_mla_mgpu -c 1 --section SpeedOfLight --section Occupancy --section WarpStateStats --section SourceCounters -o $OUT/rep python3 bench/runs/s12_mla_once.py 2>&1 | tail -1
$NCU -i $OUT/rep.ncu-rep --page details 2>&1 | grep -E "Duration|Registers|Theoretical Occ|Achieved Occ|Warp Cycles Per Issued|excessive|Memory Throughput|DRAM Thr" | head
$NCU -i $OUT/rep.ncu-rep --page source --csv --print-source sass > $OUT/sass.csv 2>&1; wc -l $OUT/sass.csv
