# Session 20, call 4: tokamax 0.0.17's ragged_dot (Mosaic GPU, sm90) beside ours — issue #6 asks for it side by side.
# Wheels carried in .whl (tokamax, qwix, einshape, pydantic, jaxtyping, ...; bench/RESULTS.md session 20).
source bench/device_env.sh
export JAX_PLATFORMS=cuda
python3 -c "import sys, types; sys.modules.setdefault('xprof', types.ModuleType('xprof')); import tokamax, qwix; print('tokamax', tokamax.__version__)" 2>&1 | tail -2
timeout 420 python3 bench/moe_tokamax.py 2>&1 | grep -v -E "Warning|warn\(" | tail -30
