# Session 30, call 5. Issue #6: the FFN's XLA around its two kernels is 99 us at 32 rows per expert and 258 us at
# 64 (call 4: FFN minus the kernels timed alone). Nsight Compute's duration of every kernel of one FFN call.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
NCU="/usr/local/cuda/bin/ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum"
for r in 32 64; do
  echo "== $r rows per expert"
  timeout 200 $NCU python3 bench/moe_profile.py --rows $r > /tmp/ncu$r.txt 2>&1
  grep -E "^  [a-zA-Z_].*\(|gpu__time_duration" /tmp/ncu$r.txt | sed -E 's/ +/ /g' | cut -c1-120 | paste - - | head -30
done
