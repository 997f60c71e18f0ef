# Session 31, call 1 (session 30 call 7, which never got a machine). Issue #6: the MoE path with the FFN handing its rows back in (token, slot) order
# (ops.expert_ffn / out_rows, new): its GPU tests, the model path under Nsight Compute (32 / 64 rows per expert),
# and the sort + FFN + combine timed both ways in one run (bench/moe.py --ffn-from-tokens).
source bench/device_env.sh
export JAX_PLATFORMS=cuda
JAX_DEFAULT_MATMUL_PRECISION=highest timeout 200 python3 -m pytest -x -q -m gpu tests/test_moe_kernels.py \
  -k "ops_run_prepared or tiled_expert_ffn or model_runs_its_mxfp4" 2>&1 | tail -2
NCU="/usr/local/cuda/bin/ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum"
for r in 32 64; do
  echo "== $r rows per expert, from tokens"
  timeout 120 $NCU python3 bench/moe_profile.py --rows $r --tokens > /tmp/ncu$r.txt 2>&1
  grep -E "^compiled|Error|error" /tmp/ncu$r.txt | cut -c1-200 | head -3
  grep -E "^  [a-zA-Z_].*\(|gpu__time_duration" /tmp/ncu$r.txt | sed -E 's/ +/ /g; s/, Context 1, Stream [0-9]+, Device 0, CC 9.0//' \
    | cut -c1-100 | paste - - | head -40
done
mkdir -p $OUT/sub
OUT=$OUT/sub timeout 240 python3 bench/moe.py --no-ep --ffn-only --ffn-sizes routed --ffn-no-peers --ffn-rows 32,64 \
  --ffn-from-tokens 2>&1 | grep -E "MoE|tile layout [0-9]|ERROR|rror" | cut -c1-260
