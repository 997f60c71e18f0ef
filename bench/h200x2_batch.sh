#!/usr/bin/env bash
# The main GPU measurements in a single call on a 2-GPU H200 host (≤ 10 minutes), run from the repo root:
#
#   bash bench/h200x2_batch.sh
#
#   GPU 1: the DSA kernels' GPU tests, then bench/dsa.py, then bench/kda.py (budgeted)
#   GPU 0: waits for the DSA tests, then bench/serve.py --gpu (the real server, kimi-k3.1-reduced, bf16); if the
#          DSA kernels failed their tests the server runs with KIMI_JAX_DSA_BACKEND=reference, and says so
#   both:  bench/cp.py (DCP2 vs TP2 decode first, then token- vs head-split prefill; budgeted)
#
# Logs and JSON go to a work folder, packed into $OUT/results.tgz; a summary of every part is printed last.
# Time limits per part come from the environment (seconds): DSA_S, KDA_S, SERVE_S, CP_S.
set -u
source bench/device_env.sh || exit 1
RES=${RES:-/tmp/res}; mkdir -p "$RES"
DSA_S=${DSA_S:-160}; KDA_S=${KDA_S:-100}; SERVE_S=${SERVE_S:-330}; CP_S=${CP_S:-180}
quiet() { grep -v -e "Error destroying CUDA event" -e "Source Location" -e "cuda_status.cc" -e "DeprecationWarning" \
                  -e "return rule(ctx" ; }

(
  export CUDA_VISIBLE_DEVICES=1
  JAX_PLATFORMS=cuda timeout -k 5 80 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_dsa_kernels.py \
      --tb=short > "$RES/dsa_tests.log" 2>&1
  echo $? > "$RES/dsa_tests.rc"
  OUT="$RES" timeout -k 5 "$DSA_S" python3 bench/dsa.py --budget $((DSA_S - 12)) 2>&1 | quiet > "$RES/dsa.log"
  OUT="$RES" timeout -k 5 "$KDA_S" python3 bench/kda.py --budget $((KDA_S - 15)) 2>&1 | quiet > "$RES/kda.log"
) &
gpu1=$!

(
  export CUDA_VISIBLE_DEVICES=0
  while [ ! -f "$RES/dsa_tests.rc" ]; do sleep 2; done
  if [ "$(cat "$RES/dsa_tests.rc")" != 0 ]; then
    echo "DSA GPU tests failed: serving with KIMI_JAX_DSA_BACKEND=reference" > "$RES/serve_note.txt"
    export KIMI_JAX_DSA_BACKEND=reference
  fi
  OUT="$RES" timeout -k 5 "$SERVE_S" python3 bench/serve.py --gpu --startup-timeout $((SERVE_S - 90)) 2>&1 | quiet > "$RES/serve.log"
) &
gpu0=$!
wait $gpu1 $gpu0

OUT="$RES" timeout -k 5 "$CP_S" python3 bench/cp.py --reps 2 --budget $((CP_S - 25)) --grace 15 2>&1 | quiet > "$RES/cp.log"

tar czf "$OUT/results.tgz" -C "$RES" . 2>/dev/null
echo "=== DSA tests (rc $(cat "$RES/dsa_tests.rc"))"; tail -12 "$RES/dsa_tests.log"
echo "=== DSA bench"; tail -30 "$RES/dsa.log"
echo "=== KDA bench"; tail -14 "$RES/kda.log"
echo "=== serve"; cat "$RES/serve_note.txt" 2>/dev/null; tail -22 "$RES/serve.log"
echo "=== CP"; tail -24 "$RES/cp.log"
