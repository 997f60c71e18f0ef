# Session 31, call 4. Issue #6: the model's MoE path under Nsight Compute at 32 / 64 rows per expert with the dispatch
# plan ranked by counting (`ops.sort_tokens`, P² compares; call 3: the one-key sort 30.9 µs, argsort 31.9 in
# call 1), then the path timed (bench/moe.py --ffn-from-tokens).
source bench/device_env.sh
export JAX_PLATFORMS=cuda
NCU="/usr/local/cuda/bin/ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum"
for r in 32 64; do
  echo "== $r rows per expert, from tokens"
  timeout 200 $NCU python3 bench/moe_profile.py --rows $r --tokens > /tmp/ncu$r.txt 2>&1; echo "rc=$?"
  grep -E "^compiled|Error|error" /tmp/ncu$r.txt | cut -c1-120 | head -3
  grep -E "^  [a-zA-Z_].*\(|gpu__time_duration" /tmp/ncu$r.txt | sed -E 's/ +/ /g; s/, Context 1, Stream [0-9]+, Device 0, CC 9.0//' \
    | cut -c1-100 | paste - - | head -40
  grep -qE "gpu__time_duration" /tmp/ncu$r.txt || tail -5 /tmp/ncu$r.txt
done
mkdir -p $OUT/sub
OUT=$OUT/sub timeout 300 python3 bench/moe.py --no-ep --ffn-only --ffn-sizes routed --ffn-no-peers --ffn-rows 32,64 \
  --ffn-from-tokens 2>&1 | grep -E "MoE|tile layout [0-9]|ERROR|rror" | cut -c1-300
