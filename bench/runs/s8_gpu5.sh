source bench/device_env.sh
( JAX_PLATFORMS=cuda timeout 280 python3 -m pytest -q -m gpu tests/test_dsa_kernels.py tests/test_kernel_path.py -k "dsa or pads or sparse or indexer or q_prepared or lazy or storage" --tb=line 2>&1 | grep -v "Warning\|warn\|return rule\|^tests/" | tail -10 )
timeout 200 python3 bench/dsa.py --batches 32 --heads 12 --contexts 32768 --only sp128_qk_s5_pf_qi,sp128_qk_s5_pf_qi_1w,sr16_bk32_s5_qi_ns8 --budget 180 2>&1 | grep -E "tuning_indexer|^indexer ctx|^indexer score|^sparse MLA ctx|rror" | cut -c1-700 | tail -6
