source bench/device_env.sh
( JAX_PLATFORMS=cuda timeout 150 python3 -m pytest -q -x -m gpu tests/test_kernel_path.py -k "dsa and storage" --tb=short 2>&1 | grep -v "Warning\|warn" | tail -45 )
timeout 120 python3 bench/dsa_profile.py --time 2>&1 | tail -4
NCU="/usr/local/cuda/bin/ncu --profile-from-start off --clock-control none"
timeout 120 $NCU --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__grid_size,launch__registers_per_thread python3 bench/dsa_profile.py > $OUT/ncu_all.txt 2>&1
grep -E "^  [a-zA-Z_]|gpu__time|dram__bytes|grid_size|registers" $OUT/ncu_all.txt | head -80
for k in sparse_mla_decode dsa_indexer_scores; do
timeout 150 $NCU -k regex:$k -c 1 --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section LaunchStats python3 bench/dsa_profile.py > $OUT/ncu_$k.txt 2>&1
grep -vE "^==PROF==|^ *-+ *$" $OUT/ncu_$k.txt | tail -75
done
