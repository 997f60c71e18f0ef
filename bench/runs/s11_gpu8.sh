# Session 11, call 8: why the Mosaic GPU MXFP4 kernels stop at ~2.2 TB/s (the fp8 path decodes in half the
# instructions of the bf16 one, yet runs at the same speed): ncu stall breakdown of both, then a few shapes.
source bench/device_env.sh
NCU="/usr/local/cuda/bin/ncu --clock-control none -k regex:mosaic -c 1 --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --print-details all"
for C in '{"mma": "fp8", "rows": 8, "kh": 256, "steps": 3}' '{"ctas_per_sm": 3, "steps": 3}'; do
  echo "=== ncu $C"
  timeout 120 $NCU python3 bench/moe.py --no-ep --mxfp4-only --q-rows 8 --budget 100 --q-configs '[]' --mgpu-configs "[$C]" 2>&1 | grep -E "Duration|Registers Per|Warp Cycles Per Issued|Issued Warp|No Eligible|Active Warps Per|Eligible Warps|Achieved Occupancy|DRAM Throughput|L1/TEX Hit|Mem Busy|Max Bandwidth|Stall|stall|Shared Memory Configuration Size|Dynamic Shared" | grep -v "^\s*$" | head -40
done
timeout 200 python3 bench/moe.py --no-ep --mxfp4-only --q-rows 8 --budget 180 --q-configs '[]' --mgpu-configs '[{"mma": "fp8", "rows": 8, "kh": 512, "steps": 2}, {"mma": "fp8", "rows": 8, "kh": 256, "steps": 4}, {"mma": "fp8", "rows": 8, "kh": 256, "steps": 2, "ctas_per_sm": 3}, {"ctas_per_sm": 3, "steps": 4}, {"kh": 64, "ctas_per_sm": 4, "steps": 6}]' 2>&1 | grep -E "MXFP4 |FAIL|Error" | cut -c1-300
