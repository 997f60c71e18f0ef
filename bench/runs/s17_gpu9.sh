# Session 17, call 9: PTX of the XLA plan (8- and 16-row tiles) and the in-kernel plan, for ptxas -v here: which part
# of the in-kernel plan's kernel takes it from 95 to 127 registers (bench/runs/s17_ptx_probe.py).
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 200 python3 bench/runs/s17_ptx_probe.py $OUT/ptx 2>&1 | grep -v "nvdisasm\|Source Location\|dump.cc\|^$" | tail -5
find $OUT/ptx -type f ! -name "*.ptx" -delete; find $OUT/ptx -name "*.ptx" | head
