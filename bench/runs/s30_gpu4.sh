# Session 30, call 4. Issue #6: bench/moe_parts.py as committed (every variant, the whole FFN and the copy bandwidth
# in the same run) at 32 and 64 rows per expert; then issue #5's pending chain floor and op (s29_gpu6.sh).
source bench/device_env.sh
export JAX_PLATFORMS=cuda
mkdir -p $OUT/sub
OUT=$OUT/sub timeout 240 python3 bench/moe_parts.py --rows 32 2>&1 | grep -v "^WARNING" | tail -10
timeout 200 python3 bench/moe_parts.py --rows 64 --variants real,free,stream,free_l2 2>&1 | grep -v "^WARNING" | tail -7
timeout 150 python3 bench/mla_mgpu.py --ops floor,op --batches 32 --no-triton \
  --configs '[{}, {"producer":true}]' 2>&1 | grep -E "^mgpu|^chain|ERROR"
