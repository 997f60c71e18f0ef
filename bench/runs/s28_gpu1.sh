# Session 28, call 1. Issue #5: where a sparse-MLA CTA's time goes — the kernel's new globaltimer timeline
# (kernel_call(trace=True)): its GPU test, then the timeline at B = 1 and B = 32 for the default (2 warpgroups x 4
# splits) and one warpgroup x 8 splits. Both Mosaic kernels' ptxas reports (#5 and #6): does ptxas serialise their
# wgmmas (C7515, e.g. "insufficient register resources")? Then speculative decoding with the count-based
# acceptance estimate.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
mkdir -p $OUT/sub $OUT/ptx /tmp/dump
MOSAIC_GPU_DUMP_TO=/tmp/dump MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_PTXAS=1 timeout 150 python3 -m pytest -q -m gpu \
  tests/test_sparse_mgpu.py -k "timeline or 12-2048-4-2-last-kernel" > /tmp/sparse_test.log 2>&1
tail -3 /tmp/sparse_test.log
OUT=$OUT/sub timeout 150 python3 bench/mla_mgpu.py --ops trace,kernel --batches 1,32 --no-triton \
  --configs '[{}, {"splits": 8, "warpgroups": 1}]' 2>&1 | grep -v "^WARNING\|^I0000" | tail -60
mkdir -p /tmp/dump_moe
MOSAIC_GPU_DUMP_TO=/tmp/dump_moe MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_PTXAS=1 OUT=$OUT/sub/moe timeout 150 \
  python3 bench/moe.py --no-ep --ffn-only --ffn-sizes routed --ffn-no-peers --ffn-rows 32 --ffn-from-tokens \
  --budget 60 > /tmp/moe.log 2>&1
grep -E 'MXFP4 FFN [0-9]+ rows/expert|rror' /tmp/moe.log | cut -c1-150
for d in /tmp/dump /tmp/dump_moe; do
  echo "== $d: $(ls $d | wc -l) files"; ls -S $d | head -12
  grep -l -i -E "serializ|C75[0-9][0-9]" $d/* 2>/dev/null | head
  grep -h -i -E "serializ|C75[0-9][0-9]|Used [0-9]+ registers|spill" $d/* 2>/dev/null | sort | uniq -c | head -30
done
grep -h -i -E "serializ|C75[0-9][0-9]" /tmp/sparse_test.log /tmp/moe.log | sort | uniq -c | head
for d in /tmp/dump /tmp/dump_moe; do
  for f in $(ls -S $d/*.ptx 2>/dev/null | head -6); do gzip -c $f > $OUT/ptx/$(basename $d)_$(basename $f).gz; done
done
ls -la $OUT/ptx
timeout 200 python3 bench/spec_decode.py --gpu --max-tokens 96 --scenarios repeat,reject 2>&1 \
  | grep -v "^WARNING\|^I0000" | tee $OUT/sub/spec_decode.log | tail -14
