# Source on a GPU host before running the benches in one go:  source bench/device_env.sh
# Installs the wheels carried in .whl/ (fla-core, jax-triton, and the server stack the CUDA image lacks:
# fastapi, uvicorn, openai, pydantic…) into /tmp/site and puts this checkout on PYTHONPATH.
# Fetch the wheels on a machine with pip access first (`pip download --no-deps -d .whl PACKAGE==VERSION`;
# docs/performance.md lists the versions each figure was measured with).
set -o pipefail
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed" >&2; return 1; }
fi
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
python3 -c 'import jax, torch; print("jax", jax.__version__, jax.devices(), "| torch", torch.__version__)'
