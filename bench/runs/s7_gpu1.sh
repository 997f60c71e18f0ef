source bench/device_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
( JAX_PLATFORMS=cuda timeout 150 python3 -m pytest -q -m gpu tests/test_kernel_path.py -k dsa 2>&1 | tail -5 )
timeout 380 python3 bench/dsa.py --batches 32 --heads 12 --only sr16_bk32_s5,sr16_bk16_s6,sr16_bk64_s5,sr16_bk32_s5_ns8,sr16_bk16_s6_ns8,sr16_bk32_ns8,sp128_qk_s3_pf,sp128_qk_s5_pf,sp64_qk_s6_pf,sp64_qk_s8_pf,sp256_qk_w8_s5_pf --budget 330 2>&1 | tail -60
