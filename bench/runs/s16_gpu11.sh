# Session 16, call 11: the XLA kernels around the Mosaic MXFP4 op (store="rows", 8 rows per expert), one by one:
# ncu's per-kernel summary of gpu time over three calls of the jitted op (bench/runs/s16_moe_kernels.py).
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 200 /usr/local/cuda/bin/ncu --clock-control none --metrics gpu__time_duration.sum --print-summary per-kernel python3 bench/runs/s16_moe_kernels.py > $OUT/ncu.txt 2>&1
echo "rc=$? lines $(wc -l < $OUT/ncu.txt)"; grep -c "gpu__time_duration" $OUT/ncu.txt
