# Session 14, call 2: whole-op timings (call 1 ran out of time after the kernel-alone rows) of the default, both
# fp8 products, and the one-launch op (prep="kernel", merge="last"), against the Triton storage preset.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 300 python3 bench/mla_mgpu.py --ops op --configs '[{}, {"logits_mma": "fp8", "value_mma": "fp8"}, {"prep": "kernel", "merge": "last"}, {"prep": "kernel", "merge": "last", "logits_mma": "fp8", "value_mma": "fp8"}]' 2>&1 | grep -vE "^\s*$|Warning|warn" | tail -10
