# Session 11, call 1: (a) how fast JAX's bundled Mosaic GPU mixed-type kernel (int8 weights converted in registers,
# wgmma A operand from registers, TMA + warp-specialised pipeline) streams weights at the MXFP4 decode shape
# (bench/mgpu_probe.py); (b) MXFP4 at 8 rows per expert with shorter contraction steps (fewer registers, more
# programs per SM) — never timed with the PTX decodes.
source bench/device_env.sh
timeout 170 python3 bench/mgpu_probe.py --rows 16,32 --budget 140 2>&1 | grep -v "^ *$" | tail -16
timeout 300 python3 bench/moe.py --no-ep --mxfp4-only --q-rows 8 --budget 270 --q-configs '[{}, {"bk": 128}, {"bk": 128, "num_stages": 4}, {"bk": 128, "num_stages": 5}, {"bk": 64, "num_stages": 4}, {"bk": 64, "num_stages": 6}, {"bk": 256}, {"bk": 128, "bn": 128, "num_warps": 8}, {"bk": 256, "num_stages": 2}, {"bk": 128, "bn": 32}]' 2>&1 | grep -E "MXFP4 8 |copy bandwidth|FAIL|Error" | cut -c1-260
