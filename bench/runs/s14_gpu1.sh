# Session 14, call 1: the first GPU run of session 13's sparse-MLA variants (prep="kernel", logits_mma / value_mma
# ="fp8"), each group of GPU tests under its own timeout (a new kernel can hang), the default path re-verified after
# session 13's CPU-only refactors, then kernel-alone and whole-op timings of the configs whose tests passed.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
T=tests/test_sparse_mgpu.py
run() {  # name, timeout, -k expression
  timeout $2 python3 -m pytest -q -m gpu $T -k "$3" --tb=short -p no:cacheprovider > $OUT/$1.txt 2>&1
  echo "$1 rc=$?: $(grep -E '[0-9]+ (passed|failed)' $OUT/$1.txt | tail -1)"
}
run default 150 "xla] or configs"
run prep 120 "kernel] or kernel-bf16"
run fp8l 120 "fp8] and not fp8-fp8"
run fp8v 120 "fp8v or fp8-fp8"
C='{}'
grep -q " passed" $OUT/fp8l.txt && ! grep -q failed $OUT/fp8l.txt && C="$C, {\"logits_mma\": \"fp8\"}"
grep -q " passed" $OUT/fp8v.txt && ! grep -q failed $OUT/fp8v.txt && C="$C, {\"logits_mma\": \"fp8\", \"value_mma\": \"fp8\"}"
grep -q " passed" $OUT/prep.txt && ! grep -q failed $OUT/prep.txt && C="$C, {\"prep\": \"kernel\", \"merge\": \"last\"}"
echo "bench configs: [$C]"
timeout 260 python3 bench/mla_mgpu.py --ops kernel,op --configs "[$C]" 2>&1 | grep -vE "^\s*$|Warning|warn" | tail -14
