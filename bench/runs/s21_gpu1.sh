# Session 21, call 1: tokamax 0.0.17's ragged_dot (Mosaic GPU and Triton, sm90) beside ours — issue #6 asks for it
# side by side. Wheels carried in .whl (tokamax, qwix, einshape, pydantic, jaxtyping, ...; bench/RESULTS.md session 20)
# and .whl/tokamax (jax-triton 0.4.1: tokamax calls triton_call(out_type=...), which 0.3.1 lacks; none of our code
# imports jax-triton). bench/moe_tokamax.py puts a stand-in for xprof, imported only by tokamax's own benchmarking.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_tk .whl/tokamax/*.whl
export PYTHONPATH="/tmp/site_tk:$PYTHONPATH"
timeout 480 python3 bench/moe_tokamax.py 2>&1 | grep -E "^(ours|tokamax|dense|copy|jax|done)" | cut -c1-700
