# Session 19, call 4 (the last of the budget): the K3 vision tower (new this session) on the H200, bf16, one image
# per call at 448 / 896 / 1792 pixels (1792 = the processor's 16384-patch budget).
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 170 python3 bench/vision.py --sides 448,896,1792 --reps 3 2>&1 | grep -v Warning | tail -8
