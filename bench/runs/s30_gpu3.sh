# Session 30, call 3. Issue #6: call 2 showed the kernels at 32 rows per expert take 423 + 213 us even with a free
# decode. Is that the tensor cores (64 x 40 x 16 wgmmas) or the stream? Free decode with half the MMAs, no decode
# (Ran as bench/runs/s30_ffn_probe.py, since moved to bench/moe_parts.py, whose lines now also give fractions of copy.)
# and no MMAs, and the free decode with the weights served from L2.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 250 python3 bench/moe_parts.py --rows 32 --variants real,free,freehalf,stream,free_l2,stream_l2 \
  2>&1 | grep -v "^WARNING" | tail -7
timeout 200 python3 bench/moe_parts.py --rows 64 --variants freehalf,stream,free_l2 \
  2>&1 | grep -v "^WARNING" | tail -3
