# Session 11, call 2: the probe again against torch's copy bandwidth (the other benches' denominator), then every
# GPU-marked test at this commit (regression check; fla-core is not carried, so fla comparisons skip).
source bench/device_env.sh
timeout 120 python3 bench/mgpu_probe.py --rows 16,32 --budget 100 2>&1 | grep -v "^ *$" | tail -14
JAX_PLATFORMS=cuda timeout 400 python3 -m pytest -q -m gpu tests/ -x 2>&1 | tail -6
