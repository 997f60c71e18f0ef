# Session 28, call 3. Issue #5: the whole op with mma_wait="chunk" (call 2: kernel alone 28.3 vs 31.4 us, 220
# registers and no spills vs 255 with spills) against the default, and with 64-column chunks; the whole GPU test
# file first. Then speculative decoding, both scenarios, with the policy timing each whole step (inputs to tokens
# handed out) after the work queued in front of it.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
mkdir -p $OUT/sub
timeout 130 python3 -m pytest -q -m gpu tests/test_sparse_mgpu.py 2>&1 | tail -3
OUT=$OUT/sub timeout 200 python3 bench/mla_mgpu.py --ops op,kernel --batches 32 --no-triton \
  --configs '[{}, {"mma_wait":"chunk"}, {"mma_wait":"chunk","logits_chunk":64,"value_keys":16}]' 2>&1 \
  | grep -E "^mgpu|ERROR"
timeout 220 python3 bench/spec_decode.py --gpu --max-tokens 96 --scenarios repeat,reject 2>&1 \
  | grep -v "^WARNING\|^I0000" | tail -14
