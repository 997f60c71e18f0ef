# Session 27, call 5 (issue #6): the FFN from the tokens at 64 rows per expert, where the x gather's forms differ
# most (probe: 55 µs padded vs 21 from the tokens into aligned groups): default, aligned, default, aligned, aligned
# + down on three warpgroups (interleaved: the runs drift by ±20 µs); then 8 rows: default, aligned.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
mkdir -p $OUT/sub
C='"kh":128,"steps":4,"ctas_per_sm":1,"plan":"xla"'
D3="\"down_config\":{\"rows\":80,\"warpgroups\":3,$C}"
OUT=$OUT/sub/r64 timeout 200 python3 bench/moe.py --no-ep --ffn-only --ffn-sizes routed --ffn-no-peers \
  --ffn-rows 64 --ffn-from-tokens --budget 190 \
  --ffn-configs "[{\"x_rows\":\"aligned\"},{},{\"x_rows\":\"aligned\"},{\"x_rows\":\"aligned\",$D3}]" 2>&1 \
  | grep -E 'MXFP4 FFN [0-9]+ rows/expert|rror' | cut -c1-130
OUT=$OUT/sub/r8 timeout 120 python3 bench/moe.py --no-ep --ffn-only --ffn-sizes routed --ffn-no-peers \
  --ffn-rows 8 --ffn-from-tokens --budget 110 --ffn-configs '[{"x_rows":"aligned"}]' 2>&1 \
  | grep -E 'MXFP4 FFN [0-9]+ rows/expert|rror' | cut -c1-130
