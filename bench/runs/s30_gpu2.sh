# Session 30, call 2. Issue #6 at 32 (and 64) rows per expert: the FFN's two kernels alone, as they are, with a
# free decode, and with the decode but half the MMAs (bench/moe_parts.py) — which part bounds them.
# (Ran as bench/runs/s30_ffn_probe.py, since moved to bench/moe_parts.py, whose lines now also give fractions of copy.)
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 200 python3 bench/moe_parts.py --rows 32 --variants real,free,half 2>&1 | grep -v "^WARNING" | tail -5
timeout 150 python3 bench/moe_parts.py --rows 64 --variants real,free,half 2>&1 | grep -v "^WARNING" | tail -5
