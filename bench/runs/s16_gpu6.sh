# Session 16, call 6: the Mosaic MXFP4 kernel's shape knobs again now that its decode is cheaper (placed layout),
# at 8, 32 and 64 rows per expert; and the placed kernel's PTX (8-row tiles) for a SASS count on the CPU.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
mkdir -p $OUT/dump $OUT/ptx
PLACED_ONLY=1 MOSAIC_GPU_DUMP_TO=$OUT/dump timeout 100 python3 bench/runs/s16_placed_kernel_probe.py 2>&1 | grep -E "differ"
cp $OUT/dump/*.ptx $OUT/ptx/; rm -rf $OUT/dump
timeout 400 python3 bench/moe.py --no-ep --mxfp4-only --q-rows 8,32,64 --budget 390 --q-configs '[]' --mgpu-configs '[{}, {"kh": 256}, {"ctas_per_sm": 4}, {"steps": 4}, {"kh": 256, "steps": 2}, {"rows": 16}, {"ctas_per_sm": 2, "steps": 5}]' 2>&1 | grep -E "MXFP4 .*rows|Error" | sed -E 's/row prep.*//' | tail -24
