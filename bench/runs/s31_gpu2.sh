# Session 31, call 2. Issue #6: call 1 showed the slot-order combine slower than two gathers (981 vs 929 µs at
# 32 rows) with its reduction at 106 µs; the index chain is now composed and materialised before it. The model
# path under Nsight Compute at 32 rows, then the three ways timed in one run (bench/moe.py --ffn-from-tokens).
source bench/device_env.sh
export JAX_PLATFORMS=cuda
NCU="/usr/local/cuda/bin/ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum"
for r in 32; do
  echo "== $r rows per expert, from tokens"
  timeout 120 $NCU python3 bench/moe_profile.py --rows $r --tokens > /tmp/ncu$r.txt 2>&1
  grep -E "Error|error" /tmp/ncu$r.txt | cut -c1-200 | head -3
  grep -E "^  [a-zA-Z_].*\(|gpu__time_duration" /tmp/ncu$r.txt | sed -E 's/ +/ /g; s/, Context 1, Stream [0-9]+, Device 0, CC 9.0//' \
    | cut -c1-100 | paste - - | grep -v "us [0-9]\.[0-9]*$" | head -40
done
mkdir -p $OUT/sub
OUT=$OUT/sub timeout 300 python3 bench/moe.py --no-ep --ffn-only --ffn-sizes routed --ffn-no-peers --ffn-rows 32,64 \
  --ffn-from-tokens 2>&1 | grep -E "MoE|tile layout [0-9]|ERROR|rror" | cut -c1-300
