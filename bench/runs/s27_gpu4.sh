# Session 27, call 4 (the device was rarely available: calls 1 and 3 folded into one). Issue #6: device tests of the
# token path (ops.expert_ffn hands the tile-layout FFN the tokens; a loaded model), then the FFN at 32 rows per
# expert from the tokens: default, x in 8-row-aligned groups, that + down on three warpgroups, default again.
# Then speculative decoding with the median-based adaptive policy (session 26, CPU-tested only).
source bench/device_env.sh
export JAX_PLATFORMS=cuda
mkdir -p $OUT/sub
JAX_DEFAULT_MATMUL_PRECISION=highest timeout 120 python3 -m pytest -q -m gpu tests/test_moe_kernels.py \
  -k "ops_run_prepared or model_runs_its_mxfp4" 2>&1 | tail -2
C='"kh":128,"steps":4,"ctas_per_sm":1,"plan":"xla"'
D3="\"down_config\":{\"rows\":40,\"warpgroups\":3,$C}"
OUT=$OUT/sub/r32 timeout 170 python3 bench/moe.py --no-ep --ffn-only --ffn-sizes routed --ffn-no-peers \
  --ffn-rows 32 --ffn-from-tokens --budget 160 \
  --ffn-configs "[{\"x_rows\":\"aligned\"},{\"x_rows\":\"aligned\",$D3},{}]" 2>&1 \
  | grep -E 'MXFP4 FFN [0-9]+ rows/expert|rror' | cut -c1-150
timeout 200 python3 bench/spec_decode.py --gpu --max-tokens 96 --scenarios repeat,reject 2>&1 \
  | grep -v "^WARNING\|^I0000" | tee $OUT/sub/spec_decode.log | tail -12
