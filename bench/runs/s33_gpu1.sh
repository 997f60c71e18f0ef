# Session 33, call 1. Speculative decoding with a draft model on the H200 (session 32 built it on CPU only), and
# the new draft_sample_method probabilistic: the GPU backend runs the spec-decode tests (float32 tiny model, matmuls
# at full precision as in session 25), then kimi-k3.1-reduced drafts for itself at temperature 1, greedy drafts
# against drafts sampled from q.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
mkdir -p $OUT/sub
JAX_DEFAULT_MATMUL_PRECISION=highest timeout 260 python3 -m pytest -x -q -p no:cacheprovider tests/test_spec_decode.py \
  -k "not server_flags" 2>&1 | tail -4
OUT=$OUT/sub timeout 300 python3 bench/spec_decode.py --gpu --max-tokens 96 --max-num-seqs 4 \
  --scenarios draft,draft-sampled --temperature 1.0 2>&1 | grep -v "^WARNING\|^I0000" | tail -16
