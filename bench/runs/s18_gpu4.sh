# Session 18, call 4: call 3's model-level test failed in Orbax (the CUDA image's orbax has no
# NumpyHandler(deepcopy_host_arrays=...); convert/store.py now falls back) — it now loads the Hugging Face directory
# directly; with it the tile-layout tests once more.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 200 python3 -m pytest -q -m gpu tests/test_moe_kernels.py -k "model_runs or tiled or ops_run" --tb=short -p no:cacheprovider > $OUT/moe_tests.txt 2>&1
echo "moe gpu tests rc=$?: $(grep -E '[0-9]+ (passed|failed)' $OUT/moe_tests.txt | tail -1)"
grep -E "^FAILED|^E  " $OUT/moe_tests.txt | head -12
