# Session 25 call 3 (and 4, with the split diagnostics: log-probs on, the top-2 gap where outputs part):
# diverged from the one-token baseline; the bench now reports how many outputs are identical instead of stopping).
source bench/device_env.sh
mkdir -p $OUT/sub
timeout 540 python3 bench/spec_decode.py --gpu --max-tokens 96 2>&1 | grep -v "^WARNING\|^I0000" | tee $OUT/sub/spec_decode.log | tail -30
