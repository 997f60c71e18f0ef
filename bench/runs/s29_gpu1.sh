# Session 29, call 1: ceilings for the two failing bars, in one run.
# #5: the best read-only random-row gather a plain Triton kernel does (bench/gather_ceiling.py --triton) beside our
# kernel's gather alone (LSU, TMA) and our whole op; #6: the MXFP4 FFN beside its FLOPs as dense bf16 matmuls (the
# new ceiling row); then session 28's unrun vision re-time.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
mkdir -p $OUT/sub
timeout 150 python3 bench/gather_ceiling.py --batches 32 --ctx 32768,131072 --triton --json $OUT/gather_ceiling.json 2>&1 \
  | grep -v "^WARNING\|^I0000"
timeout 90 python3 bench/mla_gather_probe.py --configs '[{}, {"issue": "lsu"}]' 2>&1 | grep -v "^WARNING\|^I0000" | tail -6
timeout 120 python3 bench/mla_mgpu.py --ops op --batches 32 --no-triton --configs '[{}]' 2>&1 \
  | grep -v "^WARNING\|^I0000" | tail -6
OUT=$OUT/sub/ffn timeout 200 python3 bench/moe.py --no-ep --ffn-only --ffn-sizes routed --ffn-no-peers \
  --ffn-rows 8,32,64 --budget 190 2>&1 | grep -E 'MXFP4 FFN [0-9]+ rows/expert|rror|ceiling' | cut -c1-170
timeout 230 python3 bench/vision.py --path all --attention fused --sides 448,1000,1792 --reps 3 2>&1 \
  | grep -v "^WARNING\|^I0000" | tail -14
