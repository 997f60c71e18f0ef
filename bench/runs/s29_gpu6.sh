# Session 29, call 6 (the last 220 s). Call 5 hung: the producer variant that also initialised the barriers and
# translated the slots (reverted; the kernel is call 4's again, whose GPU tests passed). The chained timing's own
# cost per call (floor) and the op, default and producer, on a GPU with nothing hung on it.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
mkdir -p $OUT/sub
OUT=$OUT/sub timeout 150 python3 bench/mla_mgpu.py --ops floor,op --batches 32 --no-triton \
  --configs '[{}, {"producer":true}]' 2>&1 | grep -E "^mgpu|^chain|ERROR"
