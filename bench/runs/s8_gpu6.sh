source bench/device_env.sh
( JAX_PLATFORMS=cuda timeout 200 python3 -m pytest -q -m gpu tests/test_kernel_path.py tests/test_dsa_kernels.py -k "paged_decode or storage or indexer_q_prepared" --tb=line 2>&1 | grep -v "Warning\|warn\|return rule\|^tests/" | tail -6 )
