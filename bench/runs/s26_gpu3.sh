# Session 26 call 3 (issue #6): call 2 found gate / up fused on three compute warpgroups with 128-byte steps at
# 896 us against 959 for the default at 32 rows per expert. Confirm it, and try around it: down on four warpgroups
# (64-byte steps) after it, 32- and 48-row tiles; the default again at the end (drift within the call).
source bench/device_env.sh
export JAX_PLATFORMS=cuda
mkdir -p $OUT/sub
C='"kh":128,"steps":4,"ctas_per_sm":1,"plan":"xla"'
D2="\"down_config\":{\"rows\":40,\"warpgroups\":2,$C}"
D4="\"down_config\":{\"rows\":40,\"warpgroups\":4,\"kh\":64,\"steps\":6,\"ctas_per_sm\":1,\"plan\":\"xla\"}"
OUT=$OUT/sub timeout 280 python3 bench/moe.py --no-ep --ffn-only --ffn-sizes routed --ffn-no-peers --ffn-rows 32 \
  --budget 270 --ffn-configs "[{\"warpgroups\":3,$C,$D2},{\"warpgroups\":3,$C,$D4},
  {\"warpgroups\":3,$C,\"rows\":32,\"down_config\":{\"rows\":32,\"warpgroups\":2,$C}},
  {\"warpgroups\":3,$C,\"rows\":48,\"down_config\":{\"rows\":48,\"warpgroups\":2,$C}},
  {\"warpgroups\":3,$C,$D2},{\"warpgroups\":2}]" 2>&1 \
  | grep -E 'MXFP4 FFN [0-9]+ rows/expert: tile|rror' | cut -c1-200
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/sub/moe.json"))
for k, v in d["info"].get("ffn_us", {}).items():
    print(k.split(" MgpuConfig")[0], "rows=" + k.split("rows=")[1].split(",")[0], "W" + k.split("warpgroups=")[1][0],
          "kh", k.split("kh=")[1].split(",")[0], "down:", k.split("down_config=")[1][:120] if "down_config=Mgpu" in k else "-",
          {a: round(b) for a, b in v.items() if b})
PY
