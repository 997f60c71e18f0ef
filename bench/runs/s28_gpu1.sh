# Session 28, call 1. Issue #5: where a sparse-MLA CTA's time goes — the kernel's new globaltimer timeline
# (kernel_call(trace=True)): its GPU test, then the timeline at B = 1 and B = 32 for the default (2 warpgroups x 4
# splits) and one warpgroup x 8 splits. Then speculative decoding with the count-based acceptance estimate.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
mkdir -p $OUT/sub
timeout 150 python3 -m pytest -q -m gpu tests/test_sparse_mgpu.py -k "timeline or 12-2048-4-2-last-kernel" 2>&1 | tail -3
OUT=$OUT/sub timeout 150 python3 bench/mla_mgpu.py --ops trace,kernel --batches 1,32 --no-triton \
  --configs '[{}, {"splits": 8, "warpgroups": 1}]' 2>&1 | grep -v "^WARNING\|^I0000" | tail -60
timeout 220 python3 bench/spec_decode.py --gpu --max-tokens 96 --scenarios repeat,reject 2>&1 \
  | grep -v "^WARNING\|^I0000" | tee $OUT/sub/spec_decode.log | tail -14
