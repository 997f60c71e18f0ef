# Session 30, call 1. Issue #6 at 32 rows per expert: does ptxas serialise the MXFP4 FFN kernels' wgmmas (their A
# operands come from registers the decode writes; ptxas warns C75xx "wgmma.mma_async instructions are serialized"
# when it cannot pipeline them)? Registers and spills per kernel, the PTX for a SASS read here, and the FFN timed
# at 8 / 32 / 64 rows as a same-run baseline.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
mkdir -p $OUT/sub $OUT/ptx /tmp/d0
MOSAIC_GPU_DUMP_TO=/tmp/d0 MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_PTXAS=1 timeout 150 python3 bench/moe_profile.py \
  --rows 32 2>&1 | tail -2
echo "== $(ls /tmp/d0 | wc -l) files"; ls -S /tmp/d0 | head -12
grep -I -h -i -E "Used [0-9]+ registers|spill|C7[0-9][0-9][0-9]|serializ|warning" /tmp/d0/* 2>/dev/null | sort | uniq -c | head -20
for f in $(ls -S /tmp/d0/*.ptx 2>/dev/null | head -3); do gzip -c $f > $OUT/ptx/$(basename $f).gz; done
OUT=$OUT/sub timeout 300 python3 bench/moe.py --no-ep --ffn-only --ffn-sizes routed --ffn-no-peers \
  --ffn-rows 8,32,64 2>&1 | grep -v "^WARNING" | tail -20
