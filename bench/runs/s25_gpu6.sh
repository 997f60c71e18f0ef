# Session 25 call 7: bench/spec_decode.py --gpu with the final policy (timings kept per batch occupancy).
source bench/device_env.sh
mkdir -p $OUT/sub
timeout 330 python3 bench/spec_decode.py --gpu --max-tokens 96 2>&1 | grep -v "^WARNING\|^I0000" | tee $OUT/sub/spec_decode.log | tail -40
