# Session 30, call 2. Issue #6 at 32 (and 64) rows per expert: the FFN's two kernels alone, as they are, with a
# free decode, and with the decode but half the MMAs (bench/runs/s30_ffn_probe.py) — which part bounds them.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 200 python3 bench/runs/s30_ffn_probe.py --rows 32 2>&1 | grep -v "^WARNING" | tail -5
timeout 150 python3 bench/runs/s30_ffn_probe.py --rows 64 2>&1 | grep -v "^WARNING" | tail -5
