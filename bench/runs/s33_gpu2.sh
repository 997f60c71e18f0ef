# Session 33, call 2. Call 1's test run stopped at its timeout after 28 of the 31 tests (all passed): run the
# draft-model and sampled-draft tests on the GPU backend by themselves.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
JAX_DEFAULT_MATMUL_PRECISION=highest timeout 500 python3 -m pytest -q -p no:cacheprovider tests/test_spec_decode.py \
  -k "draft or min_1_p_over_q or bit_identical_with_q or refused" 2>&1 | tail -4
