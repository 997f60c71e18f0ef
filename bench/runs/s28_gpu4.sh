# Session 28, call 4. Issue #5 with mma_wait="chunk" as the Mosaic sparse-MLA default: the kernel's GPU tests and
# the model-level decode test through it, then the whole op at B = 8 / 16 beside the Triton storage preset (the
# dispatch sends B >= 16 to the Mosaic kernel; does the faster default move that line?) and its timeline at B = 32.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
mkdir -p $OUT/sub
timeout 100 python3 -m pytest -q -m gpu tests/test_sparse_mgpu.py -k "matches_reference or timeline" 2>&1 | tail -2
JAX_DEFAULT_MATMUL_PRECISION=highest timeout 120 python3 -m pytest -q -m gpu tests/test_kernel_path.py \
  -k "mosaic or gpu_dsa" 2>&1 | tail -2
OUT=$OUT/sub timeout 200 python3 bench/mla_mgpu.py --ops op --batches 8,16 --configs '[{}]' 2>&1 \
  | grep -E "^mgpu|^triton|ERROR"
OUT=$OUT/sub timeout 80 python3 bench/mla_mgpu.py --ops trace --batches 32 --no-triton --configs '[{}]' 2>&1 \
  | grep -A16 "^timeline"
