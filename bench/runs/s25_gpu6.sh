# Session 25 call 7: bench/spec_decode.py --gpu with the final policy (timings kept per batch occupancy, penalties per
# drafted position), 64 output tokens per request to fit the session's remaining device time.
source bench/device_env.sh
mkdir -p $OUT/sub
timeout 280 python3 bench/spec_decode.py --gpu --max-tokens 64 2>&1 | grep -v "^WARNING\|^I0000" | tee $OUT/sub/spec_decode.log | tail -40
