# Session 22, second call: s22_gpu1.sh showed the warp-specialised kernel correct with W = 2 (three device tests
# passed) and slower at 8 rows per expert (FFN 727 us vs the default's 664); its W = 4 test hung until the timeout.
# Here W = 2 at 32 and 64 rows per expert, where one warpgroup per CTA falls short of the bar, against the defaults
# (40- and 80-row tiles) in the same run.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
B="python3 bench/moe.py --no-ep --ffn-only --ffn-sizes routed --ffn-no-peers"
F='MXFP4 FFN [0-9]+ rows/expert: tile|budget|copy band|FFN weights|reference ready|rror'
W='"warpgroups":2,"ctas_per_sm":1'
mkdir -p $OUT/r32; OUT=$OUT/r32 timeout 480 $B --ffn-rows 64,32 --budget 470 --ffn-configs \
  "[{$W,\"kh\":64,\"steps\":7},{$W,\"kh\":128,\"steps\":4}]" 2>&1 | grep -E "$F" | cut -c1-400
