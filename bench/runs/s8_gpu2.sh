source bench/device_env.sh
NCU="/usr/local/cuda/bin/ncu --profile-from-start off --clock-control none"
MKW='{"block_h":16,"block_k":32,"exact":false,"num_warps":4,"num_stages":5,"slots_outside":true,"value_reload":true,"merge":"pallas","splits":8,"q_inside":true}'
timeout 150 $NCU -k regex:sparse_mla_decode -c 1 --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis_Tables --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section SourceCounters --section SchedulerStats -o $OUT/sparse -f python3 bench/dsa_profile.py --ops sparse --mla-kw "$MKW" > $OUT/ncu_sparse_run.txt 2>&1
tail -3 $OUT/ncu_sparse_run.txt
/usr/local/cuda/bin/ncu -i $OUT/sparse.ncu-rep --page details > $OUT/sparse_details.txt 2>&1
/usr/local/cuda/bin/ncu -i $OUT/sparse.ncu-rep --page source --csv --print-source sass > $OUT/sparse_source.csv 2>&1
grep -iE "stall|Bank|Warp Cycles|Issued|Eligible|Active Warps|Theoretical Occ|Achieved Occ|Duration|L1/TEX Hit|L2 Hit|Throughput|Registers|Shared Memory Config|Block Limit" $OUT/sparse_details.txt | head -70
timeout 120 $NCU -k regex:dsa_indexer -c 1 --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats python3 bench/dsa_profile.py --ops indexer --ix-kw '{"exact":false,"block_n":128,"num_warps":4,"num_stages":5,"orient":"qk","prefetch":true,"q_inside":true}' > $OUT/ncu_indexer.txt 2>&1
grep -iE "stall|Warp Cycles|Issued|Eligible|Active Warps|Occupancy|Duration|Throughput|Registers|Grid Size|Waves|Block Limit" $OUT/ncu_indexer.txt | head -40
rm -f $OUT/sparse.ncu-rep.bak
