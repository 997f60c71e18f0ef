# Session 11, call 11: the Mosaic GPU MXFP4 kernel with a warp-specialised pipeline (kernel_call_ws: one memory
# warpgroup issues the copies, 2-4 compute warpgroups decode 64 columns each): GPU tests, then timing at 8 and 32 rows.
# Outcome: no output until the call's 355 s limit (the GPU tests hung; the session's device time ran out), so the
# warp-specialised variant was never verified and is not in the code (it lowered on the CPU; its diff is s11_gpu11_ws.patch; the likely
# suspects are its pl.when around the pipeline, or the per-warpgroup epilogue). Kept as a record only.
source bench/device_env.sh
JAX_PLATFORMS=cuda timeout 200 python3 -m pytest -q -m gpu tests/test_moe_kernels.py -k mgpu 2>&1 | grep -E "passed|failed|Error|assert" | tail -8
timeout 200 python3 bench/moe.py --no-ep --mxfp4-only --q-rows 8,32 --budget 180 --q-configs '[]' --mgpu-configs '[{}, {"compute_wgs": 2, "steps": 4}, {"compute_wgs": 3, "steps": 4}, {"compute_wgs": 4, "steps": 3}, {"compute_wgs": 3, "kh": 256, "steps": 3}]' 2>&1 | grep -E "MXFP4 |FAIL|Error" | cut -c1-300
