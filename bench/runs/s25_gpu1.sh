# Session 25 call 1: speculative decoding on the GPU. First tests/test_spec_decode.py on the H200 (the KDA decode
# kernel over k + 1 tokens, paged MLA over several query positions, the verify program; float32 matmuls at full
# precision as the CPU tolerances assume; the server-flag test needs fastapi, which the image lacks), then
# bench/spec_decode.py --gpu: kimi-k3.1-reduced in bf16, 32 slots, k = 4, against the same engine one token per step.
source bench/device_env.sh
mkdir -p $OUT/sub
JAX_PLATFORMS=cuda JAX_DEFAULT_MATMUL_PRECISION=highest timeout 200 python3 -m pytest -q -x tests/test_spec_decode.py \
  -k "not server_flags" 2>&1 | tail -5
timeout 360 python3 bench/spec_decode.py --gpu --max-tokens 96 2>&1 | grep -v "^WARNING\|^I0000" | tee $OUT/sub/spec_decode.log | tail -30
