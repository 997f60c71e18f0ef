# Speculative decoding with the adaptive policy's median-based cost ratio (session 26, CPU-tested only), repeat /
# reject at 1 and 32 requests, against "always" and the one-token baseline. Then (issue #6) the MXFP4 FFN from the
# tokens at 8 and 146 rows per expert: default, x in 8-row-aligned groups, and (146) down on three warpgroups.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
mkdir -p $OUT/sub
timeout 200 python3 bench/spec_decode.py --gpu --max-tokens 96 --scenarios repeat,reject 2>&1 \
  | grep -v "^WARNING\|^I0000" | tee $OUT/sub/spec_decode.log | tail -12
C='"kh":128,"steps":4,"ctas_per_sm":1,"plan":"xla"'
OUT=$OUT/sub/r8 timeout 120 python3 bench/moe.py --no-ep --ffn-only --ffn-sizes routed --ffn-no-peers \
  --ffn-rows 8 --ffn-from-tokens --budget 110 --ffn-configs '[{"x_rows":"aligned"},{}]' 2>&1 \
  | grep -E 'MXFP4 FFN [0-9]+ rows/expert|rror' | cut -c1-150
OUT=$OUT/sub/r146 timeout 150 python3 bench/moe.py --no-ep --ffn-only --ffn-sizes routed --ffn-no-peers \
  --ffn-rows 146 --ffn-from-tokens --budget 140 \
  --ffn-configs "[{\"x_rows\":\"aligned\"},{\"x_rows\":\"aligned\",\"down_config\":{\"rows\":80,\"warpgroups\":3,$C}}]" 2>&1 \
  | grep -E 'MXFP4 FFN [0-9]+ rows/expert|rror' | cut -c1-150
