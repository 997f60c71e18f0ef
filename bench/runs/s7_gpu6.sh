source bench/device_env.sh
( JAX_PLATFORMS=cuda timeout 200 python3 -m pytest -q -m gpu tests/test_dsa_kernels.py tests/test_kernel_path.py -k "dsa or pads or sparse or indexer or q_prepared" --tb=line 2>&1 | grep -v "Warning\|warn\|return rule\|^tests/" | tail -8 )
timeout 170 python3 bench/dsa.py --batches 32 --heads 12 --contexts 32768 --only sr16_bk32_s5_qi_ns8,sr16_bk32_s5_ns8,sp128_qk_s5_pf --budget 150 2>&1 | grep -E "tuning_sparse|^sparse MLA ctx|^indexer ctx" | cut -c1-700 | tail -4
MKW='{"block_h":16,"block_k":32,"exact":false,"num_warps":4,"num_stages":5,"slots_outside":true,"value_reload":true,"merge":"pallas","splits":8,"q_inside":true}'
timeout 70 /usr/local/cuda/bin/ncu --profile-from-start off --clock-control none --section SpeedOfLight python3 bench/dsa_profile.py --ops sparse --mla-kw "$MKW" > $OUT/ncu_sparse_qi.txt 2>&1
grep -E "^  [a-zA-Z_].*Context|Duration" $OUT/ncu_sparse_qi.txt | paste - - | awk '{print $1, $(NF)}'
