# Session 27 (issue #6), call 2: x in groups aligned to 8 rows (MgpuConfig.x_rows="aligned") instead of gathered
# into the padded tile rows; down on three compute warpgroups (3584 columns = 18 items of 192 and a ragged one of
# 128). The x gather's forms alone (probe), the GPU tests of both, then the FFN at 32 rows per expert:
# default, aligned, down W = 3, both, default again (drift).
source bench/device_env.sh
export JAX_PLATFORMS=cuda
mkdir -p $OUT/sub
timeout 100 python3 bench/runs/s27_xgather.py 2>&1 | grep -v "^WARNING\|^I0000" | tee $OUT/sub/xgather.log
JAX_DEFAULT_MATMUL_PRECISION=highest timeout 200 python3 -m pytest -q -m gpu tests/test_moe_kernels.py \
  -k "tiled_expert_ffn or three_compute" 2>&1 | tail -5
C='"kh":128,"steps":4,"ctas_per_sm":1,"plan":"xla"'
D3="\"down_config\":{\"rows\":40,\"warpgroups\":3,$C}"
OUT=$OUT/sub timeout 250 python3 bench/moe.py --no-ep --ffn-only --ffn-sizes routed --ffn-no-peers --ffn-rows 32 \
  --budget 240 --ffn-configs "[{\"x_rows\":\"aligned\"},{$D3},{\"x_rows\":\"aligned\",$D3},{}]" 2>&1 \
  | grep -E 'MXFP4 FFN [0-9]+ rows/expert: tile|rror' | cut -c1-140
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/sub/moe.json"))
for k, v in d["info"].get("ffn_us", {}).items():
    down = k.split("down_config=")[1]
    print(k.split(" MgpuConfig")[0], "x_rows=" + k.split("x_rows=")[-1].split(")")[0].split(",")[0],
          "down W" + (down.split("warpgroups=")[1][0] if down.startswith("Mgpu") else "-"),
          {a: round(b) for a, b in v.items() if b})
PY
