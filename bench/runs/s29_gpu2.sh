# Session 29, call 2. Issue #5: a producer warpgroup gathers every block (MgpuSparseConfig(producer=True)), with
# the LSU copies (the fastest gather alone, call 1: 0.586 of copy against 0.416 for the TMA) or the TMA, while the
# two compute warpgroups only compute. Its GPU tests first (a short timeout: a wrong barrier hangs), then the
# whole op beside the default, then its timeline.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
mkdir -p $OUT/sub
timeout 150 python3 -m pytest -q -m gpu tests/test_sparse_mgpu.py \
  -k "(configs and (cfg14 or cfg15 or cfg16 or cfg17)) or empty_slots" 2>&1 | tail -3
OUT=$OUT/sub timeout 200 python3 bench/mla_mgpu.py --ops op --batches 32 --no-triton \
  --configs '[{}, {"producer":true,"gather":"lsu"}, {"producer":true}]' 2>&1 | grep -E "^mgpu|ERROR"
OUT=$OUT/sub timeout 100 python3 bench/mla_mgpu.py --ops trace --batches 32 --no-triton \
  --configs '[{"producer":true,"gather":"lsu"}]' 2>&1 | grep -A16 "^timeline"
