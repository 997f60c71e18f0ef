# Session 15, call 6: after the CPU-only changes (the gather builders' shared type preamble; the KDA reference's
# platform_dependent solve, which keeps XLA's triangular solve off CPU): the sparse Mosaic file, the model-level DSA
# tests and the KDA GPU tests.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
run() {  # name, timeout, pytest args…
  local name=$1 t=$2; shift 2
  timeout $t python3 -m pytest -q -m gpu "$@" --tb=short -p no:cacheprovider > $OUT/$name.txt 2>&1
  echo "$name rc=$?: $(grep -E '[0-9]+ (passed|failed)' $OUT/$name.txt | tail -1)"
}
run sparse 150 tests/test_sparse_mgpu.py
run model 150 tests/test_kernel_path.py -k "mosaic or gpu_dsa"
run kda 170 tests/test_kda_kernels.py
