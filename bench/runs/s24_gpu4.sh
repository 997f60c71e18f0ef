# Session 24 call 4: the vision tests on the GPU after the position table moved to the device (the bucketed path
# against the exact one, bf16 included, several images per call, the fused-attention test). Float32 matmuls at
# full precision: the CPU tests' tolerances assume it (XLA on a GPU takes TF32 by default; the first try of this
# call failed test_k25_matches_transformers on exactly that, a test of the exact path this session left alone).
source bench/device_env.sh
export JAX_PLATFORMS=cuda JAX_DEFAULT_MATMUL_PRECISION=highest
timeout 300 python3 -m pytest -q tests/test_vision.py 2>&1 | tail -4
