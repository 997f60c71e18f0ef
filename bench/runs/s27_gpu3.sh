# Session 27 (issue #6), call 3: the FFN from the tokens (the model's path: ops.expert_ffn now hands the tile-layout
# FFN the tokens and the row -> token map, so x's planes are made on the tokens and gathered as half-rows), against
# the dispatch gather followed by the FFN on sorted rows; with x in the padded tile rows or 8-row-aligned groups,
# and down on three compute warpgroups. Device tests of the token path first (ops and a loaded model).
source bench/device_env.sh
export JAX_PLATFORMS=cuda
mkdir -p $OUT/sub
JAX_DEFAULT_MATMUL_PRECISION=highest timeout 150 python3 -m pytest -q -m gpu tests/test_moe_kernels.py \
  -k "ops_run_prepared or model_runs_its_mxfp4" 2>&1 | tail -3
C='"kh":128,"steps":4,"ctas_per_sm":1,"plan":"xla"'
for R in 40 80; do
  rows=$([ $R = 40 ] && echo 32 || echo 64)
  D3="\"down_config\":{\"rows\":$R,\"warpgroups\":3,$C}"
  OUT=$OUT/sub/r$rows timeout 170 python3 bench/moe.py --no-ep --ffn-only --ffn-sizes routed --ffn-no-peers \
    --ffn-rows $rows --ffn-from-tokens --budget 160 \
    --ffn-configs "[{\"x_rows\":\"aligned\"},{\"x_rows\":\"aligned\",$D3},{}]" 2>&1 \
    | grep -E 'MXFP4 FFN [0-9]+ rows/expert|rror' | cut -c1-150
done
python3 - <<'PY'
import json, os, glob
for f in sorted(glob.glob(os.environ["OUT"] + "/sub/r*/moe.json")):
    d = json.load(open(f))
    for k, v in d["info"].get("ffn_us", {}).items():
        down = k.split("down_config=")[1]
        print(k.split(" MgpuConfig")[0], "x_rows=" + k.split("x_rows=")[-1].split(")")[0].split(",")[0],
              "down W" + (down.split("warpgroups=")[1][0] if down.startswith("Mgpu") else "-"),
              {a: round(b) for a, b in v.items() if b})
PY
