# Session 12, call 6 (the last ~150 s of device time): the untested warpgroups=4 path of sparse_mgpu — one GPU test
# under a short timeout, then the kernel alone at B = 32, H = 12, ctx 32K (chain of 2).
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 45 python3 -m pytest -x -q -m gpu tests/test_sparse_mgpu.py -k "12-300-2-4" 2>&1 | grep -E "passed|failed|Error|assert|rel_rms|Timeout" | tail -4
echo "test rc=${PIPESTATUS[0]}"
timeout 50 python3 bench/mla_mgpu.py --ops kernel --no-triton --chain 2 --configs '[{"warpgroups": 4, "splits": 4, "stages": 1, "logits_chunk": 64, "value_keys": 16}]' 2>&1 | grep -E "mgpu|ERROR|copy" | tail -3
