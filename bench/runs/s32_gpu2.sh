# Session 32, call 2. Issue #6: the model's MoE path under Nsight Compute at 32 rows per expert, planned from the
# pairs (ops.expert_ffn) and with session 31's sorted plan (--sorted-plan), kernel by kernel.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
NCU="/usr/local/cuda/bin/ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum"
for variant in "" "--sorted-plan"; do
  echo "== 32 rows per expert, from tokens $variant"
  timeout 200 $NCU python3 bench/moe_profile.py --rows 32 --tokens $variant > /tmp/ncu.txt 2>&1; echo "rc=$?"
  grep -E "^compiled|Error|error" /tmp/ncu.txt | cut -c1-120 | head -3
  grep -E "^  [a-zA-Z_].*\(|gpu__time_duration" /tmp/ncu.txt | sed -E 's/ +/ /g; s/, Context 1, Stream [0-9]+, Device 0, CC 9.0//' \
    | cut -c1-100 | paste - - | head -40
  grep -qE "gpu__time_duration" /tmp/ncu.txt || tail -5 /tmp/ncu.txt
done
