# Session 17, call 4: call 3's ncu showed the in-kernel plan's kernel at 127 registers per thread (x tile of R + 8
# rows: a larger accumulator) -> 4 CTAs per SM fit, so the 5th of the default 5 per SM ran as a second wave
# (XLA plan: 95 registers, 5 fit). Sweep CTAs per SM for the kernel / tiles plans at 8 rows; steps / kh at 32; ncu
# launch stats at 32 rows per expert.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 200 python3 bench/moe.py --no-ep --mxfp4-only --q-rows 8 --budget 190 --q-configs '[]' --mgpu-configs '[{"ctas_per_sm": 4}, {"ctas_per_sm": 3}, {"ctas_per_sm": 4, "steps": 4}, {"ctas_per_sm": 4, "plan": "tiles"}, {"ctas_per_sm": 4, "plan": "xla"}]' 2>&1 | grep -E "MXFP4 .*rows|Error|copy" | sed -E 's/mma=.bf16., store=.rows., //' | cut -c1-300
timeout 200 python3 bench/moe.py --no-ep --mxfp4-only --q-rows 32 --budget 190 --q-configs '[]' --mgpu-configs '[{"ctas_per_sm": 1}, {"steps": 3}, {"kh": 128, "steps": 3}, {"ctas_per_sm": 3, "kh": 128}]' 2>&1 | grep -E "MXFP4 .*rows|Error" | sed -E 's/mma=.bf16., store=.rows., //' | cut -c1-300
timeout 150 /usr/local/cuda/bin/ncu --clock-control none -k regex:body_mosaic --section LaunchStats --section Occupancy --section WarpStateStats python3 bench/runs/s17_plan_probe.py 32 > $OUT/ncu_plan32.txt 2>&1
echo "ncu rc=$?"
grep -E "Registers Per|Achieved Occupancy|Block Limit Reg|Warp Cycles Per Issued|Duration|Local Memory Spilling Requests" $OUT/ncu_plan32.txt | sed -E 's/ +/ /g' | head -40
