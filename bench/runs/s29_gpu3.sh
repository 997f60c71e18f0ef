# Session 29, call 3. Issue #5: why the producer configs compute slower (call 2: 3.6 µs per block against 2.1):
# ptxas's registers and spills for the default and the producer kernel (is the consumers' code held to the
# launch's 168 registers?), and the TMA producer's timeline.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
mkdir -p $OUT/sub $OUT/ptx /tmp/d0 /tmp/d1
MOSAIC_GPU_DUMP_TO=/tmp/d0 MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_PTXAS=1 timeout 100 python3 bench/runs/s12_mla_once.py \
  '{}' 2>&1 | tail -1
MOSAIC_GPU_DUMP_TO=/tmp/d1 MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_PTXAS=1 timeout 100 python3 bench/runs/s12_mla_once.py \
  '{"producer":true}' 2>&1 | tail -1
for d in /tmp/d0 /tmp/d1; do
  echo "== $d: $(ls $d | wc -l) files"
  grep -h -i -E "Used [0-9]+ registers|spill|C75[0-9][0-9]|setmaxnreg" $d/* 2>/dev/null | sort | uniq -c | head -12
  for f in $(ls -S $d/*.ptx 2>/dev/null | head -1); do gzip -c $f > $OUT/ptx/$(basename $d).ptx.gz; done
done
OUT=$OUT/sub timeout 100 python3 bench/mla_mgpu.py --ops trace --batches 32 --no-triton \
  --configs '[{"producer":true}]' 2>&1 | grep -A16 "^timeline"
