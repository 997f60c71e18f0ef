source bench/device_env.sh
( JAX_PLATFORMS=cuda timeout 150 python3 -m pytest -q -m gpu tests/test_kernel_path.py -k dsa --tb=short 2>&1 | grep -v "Warning\|warn" | tail -25 )
( JAX_PLATFORMS=cuda timeout 150 python3 -m pytest -q -m gpu tests/test_moe_kernels.py --tb=short 2>&1 | grep -v "Warning\|warn" | tail -15 )
OUT=$OUT timeout 300 python3 bench/moe.py --sweep --no-ep --budget 260 2>&1 | tail -60
