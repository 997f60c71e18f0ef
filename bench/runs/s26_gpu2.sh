# Session 26 call 2 (issue #6): gate / up fused on THREE compute warpgroups (192-column items: 3072 = 16 of them;
# 152 registers per compute thread, 12 compute warps per SM instead of 8, each x tile read from L2 serving 192
# columns instead of 128), down on its own W = 2 config; against the default (W = 2 fused), at 32 and 64 rows
# per expert, gate / up in plane order (call 1: 946 / 1300 us). First the W = 3 device test.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
mkdir -p $OUT/sub
timeout 150 python3 -m pytest -q -x -m gpu tests/test_moe_kernels.py -k "three_compute_warpgroups" 2>&1 | tail -3
D='"down_config":{"rows":40,"kh":128,"steps":4,"ctas_per_sm":1,"plan":"xla","warpgroups":2,"gate_up":"fused"}'
D80='"down_config":{"rows":80,"kh":128,"steps":4,"ctas_per_sm":1,"plan":"xla","warpgroups":2,"gate_up":"fused"}'
OUT=$OUT/sub timeout 200 python3 bench/moe.py --no-ep --ffn-only --ffn-sizes routed --ffn-no-peers --ffn-rows 32 \
  --budget 190 --ffn-configs "[{\"warpgroups\":3,\"kh\":64,$D},{\"warpgroups\":3,\"kh\":128,$D},{\"warpgroups\":3,\"kh\":64,\"steps\":6,$D}]" 2>&1 \
  | grep -E 'MXFP4 FFN [0-9]+ rows/expert: tile|rror' | cut -c1-200
OUT=$OUT/sub timeout 200 python3 bench/moe.py --no-ep --ffn-only --ffn-sizes routed --ffn-no-peers --ffn-rows 64 \
  --budget 190 --ffn-configs "[{\"warpgroups\":3,\"kh\":64,$D80},{\"warpgroups\":3,\"kh\":128,$D80}]" 2>&1 \
  | grep -E 'MXFP4 FFN [0-9]+ rows/expert: tile|rror' | cut -c1-200
