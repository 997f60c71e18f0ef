# Session 14, call 7: what a plain XLA gather of the same 576-byte rows reaches (a ceiling reference for the
# sparse-MLA bar, which counts the same bytes).
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 120 python3 bench/mla_mgpu.py --ops gather --chain 3 --batches 32,1 2>&1 | grep -vE "^\s*$|Warning|warn" | tail -4
