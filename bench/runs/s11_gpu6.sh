# Session 11, call 6: the Mosaic GPU MXFP4 kernel with one wgmma group left in flight per step (wgmma_wait(1): the
# x buffers released a step late are no longer overwritten under a running MMA) and one-gather XLA prep; tests,
# then occupancy (CTAs per SM x stages x step width) at 8 and 32 rows, then ncu of the default.
source bench/device_env.sh
JAX_PLATFORMS=cuda timeout 200 python3 -m pytest -q -m gpu tests/test_moe_kernels.py -k mgpu 2>&1 | grep -v Deprecat | tail -4
timeout 260 python3 bench/moe.py --no-ep --mxfp4-only --q-rows 8,32 --budget 240 --q-configs '[{}]' --mgpu-configs '[{}, {"ctas_per_sm": 3, "steps": 3}, {"ctas_per_sm": 4, "steps": 3}, {"ctas_per_sm": 4, "steps": 2}, {"ctas_per_sm": 4, "kh": 64, "steps": 4}, {"ctas_per_sm": 3, "kh": 64, "steps": 6}, {"mma_inflight": 0, "ctas_per_sm": 3, "steps": 3}, {"kh": 256, "steps": 2}]' 2>&1 | grep -E "MXFP4 |FAIL|Error" | cut -c1-300
timeout 120 /usr/local/cuda/bin/ncu --clock-control none -k 'regex:mosaic' -c 1 --section LaunchStats --section Occupancy --section WarpStateStats --section SpeedOfLight python3 bench/moe.py --no-ep --mxfp4-only --q-rows 8 --budget 100 --q-configs '[]' --mgpu-configs '[{"ctas_per_sm": 4, "steps": 3}]' 2>&1 | grep -E "Duration|Registers Per|Warp Cycles Per Issued|Achieved Occupancy|Theoretical Occ|DRAM Throughput|Block Limit (Reg|Shared)|mosaic_gpu_kernel \(" | head -12
