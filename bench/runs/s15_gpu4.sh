# Session 15, call 4: the dispatch's batch boundary (MGPU_MIN_BATCH = 16): the model-level test at 16 sequences,
# and the one-launch op vs the Triton storage preset at B = 16 (and 32 again).
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 150 python3 -m pytest -q -m gpu tests/test_kernel_path.py -k "mosaic" --tb=short -p no:cacheprovider > $OUT/model.txt 2>&1
echo "model rc=$?: $(grep -E '[0-9]+ (passed|failed)' $OUT/model.txt | tail -1)"
timeout 200 python3 bench/mla_mgpu.py --ops op --batches 16,32 --configs '[{}]' 2>&1 | grep -vE "^\s*$|Warning|warn" | tail -6
