# Session 24 call 4: the vision tests on the GPU after the position table moved to the device (the bucketed path
# against the exact one, bf16 included, several images per call, the fused-attention test).
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 300 python3 -m pytest -q -x tests/test_vision.py 2>&1 | tail -3
