# Session 13, call 1: first device run of sparse_mgpu's warpgroups=2/4 path (and of fda291d's refactor), under a
# short timeout; then every sparse_mgpu GPU test, a ptxas report per config, and kernel / op timings at B=32, H=12, 32K.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 100 python3 -m pytest -x -q -m gpu tests/test_sparse_mgpu.py -k "12-300-2-4" > $OUT/first.txt 2>&1
echo "wg4 test rc=$?"; grep -E "passed|failed|Error|assert|mismatch" $OUT/first.txt | tail -8
timeout 200 python3 -m pytest -q -m gpu tests/test_sparse_mgpu.py > $OUT/all.txt 2>&1
echo "all rc=$?"; grep -E "passed|failed|FAILED|Error" $OUT/all.txt | tail -8
for c in '{}' '{"warpgroups": 4, "splits": 4, "stages": 1, "logits_chunk": 64, "value_keys": 16}' '{"warpgroups": 2, "splits": 4}'; do
  d=$OUT/dump$(echo "$c" | md5sum | cut -c1-4); mkdir -p $d
  MOSAIC_GPU_DUMP_TO=$d MOSAIC_GPU_DUMP_PTXAS=1 timeout 60 python3 bench/runs/s12_mla_once.py "$c" > $d/log.txt 2>&1
  echo "$c rc=$? $(grep -rh -E 'Used [0-9]+ registers|spill' $d 2>/dev/null | sort -u | head -4 | tr '\n' ' ')"
done
timeout 240 python3 bench/mla_mgpu.py --ops kernel,op --configs '[{}, {"warpgroups": 4, "splits": 4, "stages": 1, "logits_chunk": 64, "value_keys": 16}, {"warpgroups": 2, "splits": 4}, {"warpgroups": 2, "splits": 8}]' --op-configs '[{}]' 2>&1 | grep -vE "^\s*$|Warning|warn" | tail -14
