# Session 25 call 2: bench/spec_decode.py --gpu (call 1's tests passed; its bench stopped at load_model's
# random-weight cap, the bench now loads as the server does): kimi-k3.1-reduced in bf16, 32 slots, k = 4.
source bench/device_env.sh
mkdir -p $OUT/sub
timeout 540 python3 bench/spec_decode.py --gpu --max-tokens 96 2>&1 | grep -v "^WARNING\|^I0000" | tee $OUT/sub/spec_decode.log | tail -30
