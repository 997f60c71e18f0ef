# Session 12, call 5: sparse_mgpu with independent logits accumulators (logits_accs): GPU tests, then kernel-alone
# timings and the whole op against the Triton storage preset at B = 32, H = 12, ctx 32K.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 100 python3 -m pytest -x -q -m gpu tests/test_sparse_mgpu.py -k "configs" > $OUT/first.txt 2>&1
echo "tests rc=$?"; grep -E "passed|failed|Error|assert" $OUT/first.txt | tail -5
grep -q " passed" $OUT/first.txt || exit 0
timeout 300 python3 bench/mla_mgpu.py --ops kernel,op --configs '[{}, {"logits_accs": 3}, {"logits_accs": 9, "logits_chunk": 64}, {"logits_accs": 3, "value_keys": 64}]' --op-configs '[{}, {"logits_accs": 3}]' 2>&1 | grep -vE "^\s*$|Warning|warn" | tail -12
