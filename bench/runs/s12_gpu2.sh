# Session 12, call 2: the Mosaic GPU sparse MLA kernel — its PTX (for ptxas -v / SASS on the CPU), then kernel-alone,
# XLA-side and whole-op timings over a few configs at B = 32, H = 12, ctx 32K (chain of 3 distinct selections).
source bench/device_env.sh
export JAX_PLATFORMS=cuda
MOSAIC_GPU_DUMP_TO=$OUT/dump MOSAIC_GPU_DUMP_PTX=1 timeout 90 python3 -m pytest -x -q -m gpu tests/test_sparse_mgpu.py -k "matches_reference and 12-2048" 2>&1 | tail -2
ls $OUT/dump | head
timeout 420 python3 bench/mla_mgpu.py --ops kernel,parts,op --configs '[{}, {"splits": 4}, {"splits": 4, "stages": 4}, {"splits": 16}, {"stages": 3}, {"logits_chunk": 576}, {"value_keys": 64}]' 2>&1 | grep -vE "^\s*$|Warning|warn" | tail -30
