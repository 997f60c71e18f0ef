# Session 30, call 6. Issue #6: the model's path (ops.expert_ffn: sort, the FFN gathering x from the tokens, the
# weighted combine) under Nsight Compute at 32 and 64 rows per expert — does the combine re-read the FFN's gathered
# rows, or does XLA fuse the gather back into it?
source bench/device_env.sh
export JAX_PLATFORMS=cuda
NCU="/usr/local/cuda/bin/ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum"
for r in 32 64; do
  echo "== $r rows per expert, from tokens"
  timeout 200 $NCU python3 bench/moe_profile.py --rows $r --tokens > /tmp/ncu$r.txt 2>&1
  grep -E "^compiled|Error|error" /tmp/ncu$r.txt | cut -c1-200 | head -3
  grep -E "^  [a-zA-Z_].*\(|gpu__time_duration" /tmp/ncu$r.txt | sed -E 's/ +/ /g; s/, Context 1, Stream [0-9]+, Device 0, CC 9.0//' \
    | cut -c1-100 | paste - - | head -40
done
