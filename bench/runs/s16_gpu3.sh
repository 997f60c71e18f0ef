# Session 16, call 3: the placed PTX is exact on the GPU alone (call 2) but the kernel's results are wrong (call 1):
# read back the kernel's decoded weight (bench/runs/s16_placed_kernel_probe.py), and dump its PTX for the CPU.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
mkdir -p $OUT/ptx
MOSAIC_GPU_DUMP_TO=$OUT/ptx timeout 200 python3 bench/runs/s16_placed_kernel_probe.py 2>&1 | grep -v Warning | tail -40
ls $OUT/ptx | head; du -sh $OUT/ptx
