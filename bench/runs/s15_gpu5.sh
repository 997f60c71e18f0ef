# Session 15, call 5: the configs test, now with the three gather="lsu" configs that call 3's "-k lsu" filter missed
# (their ids are cfg8..cfg10).
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 240 python3 -m pytest -q -m gpu tests/test_sparse_mgpu.py -k "configs" --tb=short -p no:cacheprovider > $OUT/configs.txt 2>&1
echo "configs rc=$?: $(grep -E '[0-9]+ (passed|failed)' $OUT/configs.txt | tail -1)"
grep -E "^(FAILED|ERROR)" $OUT/configs.txt | head
