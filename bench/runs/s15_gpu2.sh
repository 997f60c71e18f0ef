# Session 15, call 2: the model-level Mosaic sparse-MLA test at K3's row width (R = 128 needs one warpgroup for
# merge="last"); the gather-only probe with LSU (16-byte cp.async) issue beside the TMA row copies; the one-launch
# op at B = 1 (more splits) against the Triton storage preset, for the dispatch's small-batch case.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 150 python3 -m pytest -q -m gpu tests/test_kernel_path.py -k "mosaic" --tb=short -p no:cacheprovider > $OUT/model.txt 2>&1
echo "model rc=$?: $(grep -E '[0-9]+ (passed|failed)' $OUT/model.txt | tail -1)"
timeout 200 python3 bench/mla_gather_probe.py 2>&1 | grep -vE "^\s*$|Warning|warn" | tail -8
timeout 220 python3 bench/mla_mgpu.py --ops op --batches 1 --configs '[{}, {"splits": 16}, {"splits": 32, "warpgroups": 1}]' 2>&1 | grep -vE "^\s*$|Warning|warn" | tail -8
