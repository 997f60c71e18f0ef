#!/usr/bin/env bash
# KDA on the H200 in one go (≤ 8 min): diagnostics + tuning sweep (bench/kda_gpu_diag.py, ≤ 290 s), then bench/kda.py
# (≤ 130 s) with the fastest measured tuning that compiled and passed (the exact variant if none did; bench/kda.py
# falls back to it again if its tuning fails to compile). Run from the repository root:  bash bench/kda_gpu_diag.sh
# Writes $OUT/kda_diag.json, $OUT/kda.json and the two logs.
set -u
export XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/kda_out}; export OUT; mkdir -p "$OUT"
python3 -c "import fla" 2>/dev/null || pip install --no-deps -q --target /tmp/site .whl/fla_core-0.6.0-py3-none-any.whl
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
filter() { grep -v -e "Warning" -e "warnings.warn" ; }
timeout 310 python3 bench/kda_gpu_diag.py --budget 290 2>&1 | filter | tee "$OUT/diag.log"
timeout 150 python3 bench/kda.py --budget 130 --tuning "$OUT/kda_diag.json" 2>&1 | filter | tee "$OUT/bench.log"
