# Session 23, call 5: Nsight Compute on the MXFP4 FFN at 32 rows per expert (the feasible failing bar of issue #6:
# 0.47 of copy; each 3584 x 3072 weight's kernel ~330 us against ~145 us of weight bytes at copy speed and ~100 us
# of MMAs): where do the fused gate / up kernel and down spend their time (tensor pipe, issue, stalls)?
source bench/device_env.sh
export JAX_PLATFORMS=cuda
NCU="/usr/local/cuda/bin/ncu --profile-from-start off --clock-control none"
timeout 330 $NCU --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \
  --section SchedulerStats --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
  -o $OUT/ffn32 -f python3 bench/moe_profile.py --rows 32 > $OUT/ncu_run.txt 2>&1
tail -4 $OUT/ncu_run.txt
/usr/local/cuda/bin/ncu -i $OUT/ffn32.ncu-rep --page details > $OUT/ffn32_details.txt 2>&1
grep -E "^  [a-zA-Z_]|Duration|Compute \(SM\) Throughput|Memory Throughput|Issue Slots Busy|Executed Ipc A|Warp Cycles Per Issued|No Eligible|Registers Per|Tensor|Stall|Achieved Occ" $OUT/ffn32_details.txt | cut -c1-150 | head -90
