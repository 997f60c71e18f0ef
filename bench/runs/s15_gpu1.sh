# Session 15, call 1: session 14's unrun kernel change (slots on their own barrier) through the GPU tests; the new
# model-level test (storage precision + fp8 pages -> the Mosaic sparse kernel by default); the gather-only probe.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
run() {  # name, timeout, pytest args…
  local name=$1 t=$2; shift 2
  timeout $t python3 -m pytest -q -m gpu "$@" --tb=short -p no:cacheprovider > $OUT/$name.txt 2>&1
  echo "$name rc=$?: $(grep -E '[0-9]+ (passed|failed)' $OUT/$name.txt | tail -1)"
}
run sparse 200 tests/test_sparse_mgpu.py
run model 150 tests/test_kernel_path.py -k "mosaic or gpu_dsa"
timeout 200 python3 bench/mla_gather_probe.py 2>&1 | grep -vE "^\s*$|Warning|warn" | tail -8
