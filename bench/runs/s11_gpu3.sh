# Session 11, call 3: every GPU-marked test at this commit (regression check; the files that hold GPU tests — the
# server's tests need the openai client, which the device image lacks).
source bench/device_env.sh
JAX_PLATFORMS=cuda timeout 540 python3 -m pytest -q -m gpu tests/test_kda_kernels.py tests/test_dsa_kernels.py tests/test_kernel_path.py tests/test_moe_kernels.py 2>&1 | tail -8
