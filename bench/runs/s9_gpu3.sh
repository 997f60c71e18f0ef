source bench/device_env.sh
( JAX_PLATFORMS=cuda timeout 150 python3 -m pytest -q -m gpu tests/test_dsa_kernels.py -k "fp8_dots or fp8_dot_primitive or q_prepared_in_the_kernel_equals" --tb=short 2>&1 | grep -v "Warning\|return rule" | tail -25 )
timeout 330 python3 bench/dsa.py --batches 32 --heads 12 --contexts 32768,131072 --only sp128_qk_s5_pf_qi_1w,sp128_kq_s5_pf_qi_1w_f8,sp128_kq_s5_pf_qi_f8,sp256_kq_s5_pf_qi_1w_f8,sp64_kq_s6_pf_qi_1w_f8,sr16_bk32_s5_qi_ns8 --budget 310 2>&1 | grep -E "tuning_indexer|^indexer ctx|indexer score kernel|FAIL|rror" | cut -c1-1500 | tail -14
