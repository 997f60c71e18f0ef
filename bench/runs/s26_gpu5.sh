# Session 26 call 5: the two MoE GPU tests call 4 ran out of time for (the model-level Mosaic-expert test, now with
# gate / up in plane order; the placed decode's scale edges), then speculative decoding re-timed with the adaptive
# policy's cost ratio kept per batch occupancy (session 25 timed one running mean): repeat / reject at 1 and 32
# requests.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
mkdir -p $OUT/sub
timeout 120 python3 -m pytest -q -m gpu tests/test_moe_kernels.py -k "model_runs_its_mxfp4 or placed_with_large" 2>&1 | tail -2
timeout 300 python3 bench/spec_decode.py --gpu --max-tokens 96 --scenarios repeat,reject 2>&1 \
  | grep -v "^WARNING\|^I0000" | tee $OUT/sub/spec_decode.log | tail -14
