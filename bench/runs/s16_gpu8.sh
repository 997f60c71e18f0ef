# Session 16, call 8: the placed kernel at 8 rows per expert issues ~21 instructions per 8 weights (SASS of call 6's
# PTX) yet reaches only ~0.41 of the SMs' issue rate: more CTAs per SM (95 registers: 5 fit), and ncu's stall
# breakdown of the default (4 CTAs per SM).
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 200 python3 bench/moe.py --no-ep --mxfp4-only --q-rows 8 --budget 190 --q-configs '[]' --mgpu-configs '[{}, {"ctas_per_sm": 5}, {"ctas_per_sm": 5, "steps": 2}, {"ctas_per_sm": 6, "steps": 2}, {"kh": 64, "ctas_per_sm": 6, "steps": 4}, {"kh": 64, "ctas_per_sm": 8, "steps": 3}, {"kh": 256, "ctas_per_sm": 4, "steps": 2}]' 2>&1 | grep -E "MXFP4 .*rows|Error" | sed -E 's/row prep.*//' | cut -c1-220
NCU="/usr/local/cuda/bin/ncu --clock-control none -k regex:mosaic -c 1 --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats --print-details all"
timeout 150 $NCU python3 bench/moe.py --no-ep --mxfp4-only --q-rows 8 --budget 100 --q-configs '[]' --mgpu-configs '[{}]' 2>&1 | grep -E "Duration|Registers Per|Warp Cycles Per Issued|Issued Warp|No Eligible|Active Warps Per|Eligible Warps|Achieved Occupancy|DRAM Throughput|Stall|stall|Block Limit" | grep -v "^\s*$" | head -45
