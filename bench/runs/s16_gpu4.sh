# Session 16, call 4: the placed kernel's PTX (call 3 read back wrong codes for nearly every element), to read on the CPU.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
mkdir -p $OUT/dump
PLACED_ONLY=1 MOSAIC_GPU_DUMP_TO=$OUT/dump timeout 200 python3 bench/runs/s16_placed_kernel_probe.py 2>&1 | grep -v -E "Warning|nvdisasm|Source Location|dump.cc|^$" | tail -12
mkdir -p $OUT/ptx; cp $OUT/dump/*.ptx $OUT/dump/*after_layout* $OUT/ptx/; rm -rf $OUT/dump
