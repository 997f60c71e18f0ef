# Session 12, call 3: PTX dump + ncu (speed of light, occupancy, stalls per SASS instruction) of the Mosaic GPU
# sparse MLA kernel at B = 32, H = 12, ctx 32K.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
mkdir -p $OUT/dump
MOSAIC_GPU_DUMP_TO=$OUT/dump MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_SASS=1 timeout 90 python3 bench/runs/s12_mla_once.py '{"value_keys": 64}' 2>&1 | tail -3
ls -la $OUT/dump | head
NCU=/usr/local/cuda/bin/ncu
timeout 240 $NCU --clock-control none -k regex:sparse_mla -c 1 --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SourceCounters -o $OUT/rep python3 bench/runs/s12_mla_once.py '{"value_keys": 64}' 2>&1 | tail -3
$NCU -i $OUT/rep.ncu-rep --page details 2>&1 | grep -vE "^\s*$" | head -120
$NCU -i $OUT/rep.ncu-rep --page source --csv --print-source sass > $OUT/sass.csv 2>&1; wc -l $OUT/sass.csv
