# Session 17, call 3: why the in-kernel plan's kernel is slower (267 vs 202 us at 8 rows/expert in call 2, whatever
# the items or stores): ncu launch stats, occupancy and warp-state sections of the Mosaic kernel, plan "kernel" vs
# "xla" (bench/runs/s17_plan_probe.py; only kernels named body_mosaic_gpu).
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 300 /usr/local/cuda/bin/ncu --clock-control none -k regex:body_mosaic --launch-skip 0 --section LaunchStats --section Occupancy --section WarpStateStats --section SchedulerStats --section SpeedOfLight --section MemoryWorkloadAnalysis python3 bench/runs/s17_plan_probe.py > $OUT/ncu_plan.txt 2>&1
echo "ncu rc=$?"
grep -E "body_mosaic|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit Reg|Stall|Warp Cycles Per Issued|Issued Warp|Duration|Memory Throughput|L2 Hit|Dynamic Shared|No Eligible|Local" $OUT/ncu_plan.txt | sed -E 's/ +/ /g' | head -90
