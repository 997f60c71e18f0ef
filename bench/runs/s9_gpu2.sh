source bench/device_env.sh
( JAX_PLATFORMS=cuda timeout 150 python3 -m pytest -q -m gpu tests/test_moe_kernels.py tests/test_dsa_kernels.py -k "moe or mxfp4 or grouped or convert_once" --tb=line 2>&1 | grep -v "Warning\|warn\|return rule\|^tests/" | tail -6 )
timeout 150 python3 bench/dsa.py --batches 32 --heads 12 --contexts 32768 --only sr16_bk32_s5_qi_ns8,sr16_bk32_s5_qi_co_ns8,sr16_bk32_s4_qi_cv_ns8,sr16_bk32_s5_qi_cv_ns8 --budget 140 2>&1 | grep -E "tuning_sparse|FAIL|rror" | cut -c1-900 | tail -4
NCU="/usr/local/cuda/bin/ncu --profile-from-start off --clock-control none"
MKW='{"block_h":16,"block_k":32,"exact":false,"num_warps":4,"num_stages":5,"slots_outside":true,"merge":"pallas","splits":8,"q_inside":true,"convert_once":true}'
timeout 150 $NCU -k regex:sparse_mla_decode -c 1 --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats --section SourceCounters --section SchedulerStats -o $OUT/sparse_co -f python3 bench/dsa_profile.py --ops sparse --mla-kw "$MKW" > $OUT/ncu_co_run.txt 2>&1
tail -2 $OUT/ncu_co_run.txt
/usr/local/cuda/bin/ncu -i $OUT/sparse_co.ncu-rep --page details > $OUT/sparse_co_details.txt 2>&1
/usr/local/cuda/bin/ncu -i $OUT/sparse_co.ncu-rep --page source --csv --print-source sass > $OUT/sparse_co_source.csv 2>&1
grep -iE "stall|Warp Cycles|Issued|Eligible|Active Warps|Theoretical Occ|Achieved Occ|Duration|Throughput|Registers|Block Limit" $OUT/sparse_co_details.txt | head -50
rm -f $OUT/sparse_co.ncu-rep
