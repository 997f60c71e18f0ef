# Session 25 call 6: bench/spec_decode.py --gpu with both policies: "always" (verify whenever a row drafts) and the
# engine's default "adaptive" (engine/spec_policy.py: verify only when the drafts are expected to pay).
source bench/device_env.sh
mkdir -p $OUT/sub
timeout 500 python3 bench/spec_decode.py --gpu --max-tokens 96 2>&1 | grep -v "^WARNING\|^I0000" | tee $OUT/sub/spec_decode.log | tail -40
