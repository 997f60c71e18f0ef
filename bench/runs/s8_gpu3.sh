source bench/device_env.sh
( JAX_PLATFORMS=cuda timeout 150 python3 -m pytest -q -m gpu tests/test_dsa_kernels.py -k "indexer" --tb=line 2>&1 | grep -v "Warning\|warn\|return rule\|^tests/" | tail -8 )
timeout 400 python3 bench/dsa.py --batches 32 --heads 12 --only sp128_qk_s5_pf_qi,sp128_kq_s5_pf_qi,sp128_kq_s8_pf_qi,sp256_kq_w8_s5_pf_qi,sr16_bk32_s5_qi_ns8 --budget 380 2>&1 | grep -E "tuning_indexer|^indexer ctx|^indexer score|FAIL|rror" | cut -c1-900 | tail -14
