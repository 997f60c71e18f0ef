source bench/device_env.sh
( JAX_PLATFORMS=cuda timeout 170 python3 -m pytest -q -m gpu tests/test_dsa_kernels.py tests/test_kernel_path.py -k "fp8_dots or storage or q_prepared_in_the_kernel or paged_decode" --tb=short 2>&1 | grep -v "Warning\|return rule" | tail -8 )
timeout 250 python3 bench/dsa.py --batches 1,32 --heads 12 --contexts 32768,131072 --ix-storage --only sr16_bk32_s5_qi_ns8,sr16_bk32_s5_qi --budget 230 2>&1 | grep -E "^indexer ctx|indexer score kernel|FAIL|rror" | grep -v mxfp4 | cut -c1-700 | tail -12
