source bench/device_env.sh
( JAX_PLATFORMS=cuda timeout 150 python3 -m pytest -q -m gpu tests/test_moe_kernels.py --tb=line 2>&1 | grep -v "Warning\|warn\|return rule\|^tests/" | tail -6 )
timeout 230 python3 bench/moe.py --sweep --no-ep --budget 210 2>&1 | grep -vi "warn" | tail -28 | cut -c1-400
timeout 150 python3 bench/dsa.py --batches 1 --heads 12 --contexts 32768 --only default,sp128_qk_s5_pf_qi,sr16_bk32_s5_qi,sr16_bk32_s5_qi_ns16,sr16_bk32_s5_qi_c8_lz,sr16_bk32_s5_qi_c8_lz_ns16,w16_fast --budget 130 2>&1 | grep -E "tuning_sparse|^sparse MLA ctx|^indexer ctx|FAIL|rror" | cut -c1-900 | tail -6
