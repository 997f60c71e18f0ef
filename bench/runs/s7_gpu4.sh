source bench/device_env.sh
( JAX_PLATFORMS=cuda timeout 240 python3 -m pytest -q -m gpu tests/test_kernel_path.py tests/test_dsa_kernels.py -k "dsa or pads or sparse or indexer" --tb=line 2>&1 | grep -v "Warning\|warn\|return rule\|^tests/" | tail -15 )
timeout 260 python3 bench/dsa.py --batches 32 --heads 12 --contexts 32768,131072 --only sp128_qk_s5_pf,sp128_qk_s5_pf_1w,sp128_qk_s8_pf_1w,sr16_bk32_s5_ns8 --budget 230 2>&1 | grep -E "^indexer|^sparse|tuning_indexer|FAIL|Error|error" | cut -c1-400 | tail -30
