# Session 29, call 4. Issue #5: the rows' vector loads now say their alignment (call 3's SASS: in the producer
# kernel's consumer branch 7 of the 16 LDS.128 per block became 112 LDS.U8). The whole GPU test file, then the op
# (default, TMA producer, LSU producer), the TMA producer's timeline, and the producer kernel's PTX (ptxas on the
# CPU afterwards; no grep over the dump: it holds binaries).
source bench/device_env.sh
export JAX_PLATFORMS=cuda
mkdir -p $OUT/sub $OUT/ptx /tmp/d1
timeout 150 python3 -m pytest -q -m gpu tests/test_sparse_mgpu.py 2>&1 | tail -2
OUT=$OUT/sub timeout 200 python3 bench/mla_mgpu.py --ops op --batches 32 --no-triton \
  --configs '[{}, {"producer":true}, {"producer":true,"gather":"lsu"}]' 2>&1 | grep -E "^mgpu|ERROR"
OUT=$OUT/sub timeout 100 python3 bench/mla_mgpu.py --ops trace --batches 32 --no-triton \
  --configs '[{"producer":true}]' 2>&1 | grep -A16 "^timeline"
MOSAIC_GPU_DUMP_TO=/tmp/d1 MOSAIC_GPU_DUMP_PTX=1 timeout 100 python3 bench/runs/s12_mla_once.py \
  '{"producer":true}' 2>&1 | tail -1
for f in $(ls -S /tmp/d1/*.ptx 2>/dev/null | head -1); do gzip -c $f > $OUT/ptx/d1.ptx.gz; done
