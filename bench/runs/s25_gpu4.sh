# Session 25 call 5: is call 4's bf16 divergence (natural x 32: every output parts from the one-token baseline, log-prob
# drift up to 0.86 nats before the split) speculation's, or the engine's batch numerics? "noise" decodes the same
# prompts twice without speculation, the second time in reverse slot order; then "natural" again.
source bench/device_env.sh
mkdir -p $OUT/sub
timeout 400 python3 bench/spec_decode.py --gpu --max-tokens 96 --scenarios noise,natural 2>&1 | grep -v "^WARNING\|^I0000" | tee $OUT/sub/spec_decode.log | tail -12
