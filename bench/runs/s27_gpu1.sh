# For the next session's first call: speculative decoding with the adaptive policy's median-based cost ratio
# (session 26, CPU-tested only), repeat / reject at 1 and 32 requests, against "always" and the one-token baseline.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
mkdir -p $OUT/sub
timeout 200 python3 bench/spec_decode.py --gpu --max-tokens 96 --scenarios repeat,reject 2>&1 \
  | grep -v "^WARNING\|^I0000" | tee $OUT/sub/spec_decode.log | tail -12
