# Session 29, call 5. Issue #5: with a producer the consumers prepare q first while the producer initialises the
# barriers, translates every block's slots and starts gathering (call 4: op 31.0 µs against 30.4 for the default,
# CTA 18.6 µs, 2.2 µs waiting for block 0). The producer GPU tests, the op interleaved with the default, the
# chained timing's own cost per call (floor), the producer's timeline.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
mkdir -p $OUT/sub
timeout 120 python3 -m pytest -q -m gpu tests/test_sparse_mgpu.py \
  -k "(configs and (cfg14 or cfg15 or cfg16 or cfg17)) or empty_slots or timeline" 2>&1 | tail -2
OUT=$OUT/sub timeout 220 python3 bench/mla_mgpu.py --ops floor,op --batches 32 --no-triton \
  --configs '[{}, {"producer":true}, {}, {"producer":true}]' 2>&1 | grep -E "^mgpu|^chain|ERROR"
OUT=$OUT/sub timeout 100 python3 bench/mla_mgpu.py --ops trace --batches 32 --no-triton \
  --configs '[{"producer":true}]' 2>&1 | grep -A16 "^timeline"
