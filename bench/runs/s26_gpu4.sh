# Session 26 call 4 (issue #6): after tiled_config took gate / up on three warpgroups at <= 32 rows per expert and
# the model prepares gate / up in plane order: every GPU test of the MoE file (and the model-level Mosaic-expert
# test), the FFN's defaults at 8 / 32 / 64 / 146 rows per expert, then Nsight Compute on the new 32-row FFN (the
# kernels' split of the time; session 23's profile of the old default: 559 + 274 us of kernels, 134 us of XLA).
source bench/device_env.sh
export JAX_PLATFORMS=cuda
mkdir -p $OUT/sub
timeout 230 python3 -m pytest -q -m gpu tests/test_moe_kernels.py 2>&1 | tail -3
OUT=$OUT/sub timeout 150 python3 bench/moe.py --no-ep --ffn-only --ffn-sizes routed --ffn-no-peers \
  --ffn-rows 8,32,64,146 --budget 140 2>&1 | grep -E 'MXFP4 FFN [0-9]+ rows/expert: tile|copy band|rror' | cut -c1-250
NCU="/usr/local/cuda/bin/ncu --profile-from-start off --clock-control none"
timeout 170 $NCU --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section LaunchStats \
  -o $OUT/ffn32 -f python3 bench/moe_profile.py --rows 32 > $OUT/ncu_run.txt 2>&1
tail -2 $OUT/ncu_run.txt
/usr/local/cuda/bin/ncu -i $OUT/ffn32.ncu-rep --page details > $OUT/ffn32_details.txt 2>&1
grep -E "^  [a-zA-Z_]|Duration|Memory Throughput|Issue Slots Busy|No Eligible|Registers Per|Eligible Warps" \
  $OUT/ffn32_details.txt | cut -c1-150 | head -80
