# Session 16, call 2: call 1's placed decode gave wrong results in the kernel while its NumPy model is exact; the
# PTX alone through Triton's inline asm, whole and in parts (bench/runs/s16_placed_probe.py).
source bench/device_env.sh
timeout 200 python3 bench/runs/s16_placed_probe.py 2>&1 | grep -v Warning | tail -40
