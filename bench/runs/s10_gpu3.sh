# Session 10, call 3: is x's lo plane lost in the chained fp8 dots or in the XLA split on the GPU?
source bench/device_env.sh
timeout 150 python3 bench/moe_fp8_check.py 2>&1 | grep -v Warning | tail -12
