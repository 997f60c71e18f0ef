# Session 27 (issue #6): x in groups aligned to 8 rows (MgpuConfig.x_rows="aligned") instead of gathered into
# the padded tile rows. Its x-gather forms alone (probe), the GPU tests that compare it bit for bit with the padded
# layout, then the FFN at 8 / 32 / 64 rows per expert: default, aligned, default again (drift).
source bench/device_env.sh
export JAX_PLATFORMS=cuda
mkdir -p $OUT/sub
timeout 100 python3 bench/runs/s27_xgather.py 2>&1 | grep -v "^WARNING\|^I0000" | tee $OUT/sub/xgather.log
JAX_DEFAULT_MATMUL_PRECISION=highest timeout 200 python3 -m pytest -q -m gpu tests/test_moe_kernels.py \
  -k "tiled_expert_ffn or three_compute" 2>&1 | tail -5
OUT=$OUT/sub timeout 280 python3 bench/moe.py --no-ep --ffn-only --ffn-sizes routed --ffn-no-peers --ffn-rows 8,32,64 \
  --budget 270 --ffn-configs '[{"x_rows":"aligned"},{}]' 2>&1 \
  | grep -E 'MXFP4 FFN [0-9]+ rows/expert: tile|rror' | cut -c1-140
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/sub/moe.json"))
for k, v in d["info"].get("ffn_us", {}).items():
    print(k.split(" MgpuConfig")[0], "x_rows=" + k.split("x_rows=")[1].split(")")[0].split(",")[0],
          {a: round(b) for a, b in v.items() if b})
PY
