# For the next session's first call: speculative decoding with the adaptive policy's median-based cost ratio
# (session 26, CPU-tested only), repeat / reject at 1 and 32 requests, against "always" and the one-token baseline.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
mkdir -p $OUT/sub
timeout 200 python3 bench/spec_decode.py --gpu --max-tokens 96 --scenarios repeat,reject 2>&1 \
  | grep -v "^WARNING\|^I0000" | tee $OUT/sub/spec_decode.log | tail -12
# Issue #6: the x gather's forms at K3 shapes (padded tile rows today; 8-aligned groups; planes made on the tokens)
timeout 150 python3 bench/runs/s27_xgather.py 2>&1 | grep -v "^WARNING\|^I0000" | tee $OUT/sub/xgather.log
