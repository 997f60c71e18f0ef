# Session 19, call 2: every GPU-marked test file once (sessions 16-18 ran only subsets after each change), each
# under its own timeout; the MoE file without call 1's tile-layout and model tests.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
t() { local name=$1 limit=$2; shift 2
  timeout $limit python3 -m pytest -q -m gpu "$@" --tb=short -p no:cacheprovider > $OUT/$name.txt 2>&1
  echo "$name rc=$?: $(grep -E '[0-9]+ (passed|failed|error)' $OUT/$name.txt | tail -1)"
  grep -E "^FAILED|^ERROR|^E  " $OUT/$name.txt | head -8; }
t moe 120 tests/test_moe_kernels.py -k "not tiled and not model_runs"
t kda 80 tests/test_kda_kernels.py
t sparse_mgpu 110 tests/test_sparse_mgpu.py
t dsa 130 tests/test_dsa_kernels.py
t kernel_path 140 tests/test_kernel_path.py
