source bench/device_env.sh
NCU="/usr/local/cuda/bin/ncu --profile-from-start off --clock-control none"
timeout 120 $NCU --section SpeedOfLight python3 bench/dsa_profile.py --ops sparse > $OUT/ncu_sparse_all.txt 2>&1
grep -E "^  [a-zA-Z_].*Context|Duration|Segmentation|rror" $OUT/ncu_sparse_all.txt | head -40
timeout 100 $NCU --section SpeedOfLight python3 bench/dsa_profile.py --ops indexer > $OUT/ncu_indexer_all.txt 2>&1
grep -E "^  [a-zA-Z_].*Context|Duration|Segmentation|rror" $OUT/ncu_indexer_all.txt | head -20
timeout 60 python3 bench/dsa_profile.py --time 2>&1 | tail -3
timeout 200 python3 bench/dsa.py --batches 32 --heads 12 --contexts 32768 --only sr16_bk32_s5_ns16,sr16_bk16_v256_s5_ns8,sr16_bk16_v256_s5_ns4,sr16_bk32_v256_s5_ns4,sr16_bk32_v256_s5_ns8,sr16_bk32_s5_ns8,sp128_qk_s5_pf --budget 170 2>&1 | grep -E "tuning_sparse|^sparse MLA ctx" | cut -c1-900 | tail -3
