# Session 28, call 2. Issue #5: the sparse-MLA kernel waiting for its wgmmas chunk by chunk (mma_wait="chunk": one
# chunk's A fragment live at a time instead of all 144 registers of them), alone and with four one-stage
# warpgroups; GPU tests, ptxas registers / spills, then the per-CTA timeline and the kernel alone at B = 32.
# Then speculative decoding (repeat) with each timed step waiting for the work queued in front of it.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
mkdir -p $OUT/sub /tmp/dump
timeout 150 python3 -m pytest -q -m gpu tests/test_sparse_mgpu.py \
  -k "timeline or (configs and (cfg11 or cfg12 or cfg13))" 2>&1 | tail -3
WG4='"splits":4,"stages":1,"warpgroups":4,"logits_chunk":64,"value_keys":16'
MOSAIC_GPU_DUMP_TO=/tmp/dump MOSAIC_GPU_DUMP_PTXAS=1 OUT=$OUT/sub timeout 260 python3 bench/mla_mgpu.py \
  --ops trace,kernel --batches 32 --no-triton \
  --configs "[{}, {\"mma_wait\":\"chunk\"}, {$WG4,\"mma_wait\":\"chunk\"}, {$WG4}]" 2>&1 \
  | grep -v "^WARNING\|^I0000" | grep -v "^\s*$" | tail -80
echo "== ptxas (in the order compiled)"
grep -h -o -a -E "Used [0-9]+ registers|[0-9]+ bytes spill stores, [0-9]+ bytes spill loads" /tmp/dump/* 2>/dev/null | head -40
OUT=$OUT/sub timeout 60 python3 bench/mla_mgpu.py --ops trace --batches 1 --no-triton --configs '[{}]' 2>&1 \
  | grep -v "^WARNING\|^I0000" | grep -A30 timeline
timeout 130 python3 bench/spec_decode.py --gpu --max-tokens 96 --scenarios repeat 2>&1 \
  | grep -v "^WARNING\|^I0000" | tail -8
