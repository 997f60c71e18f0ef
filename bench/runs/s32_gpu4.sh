# Session 32, call 4. Issue #6: call 3 timed the FFN slower than call 1 (674 / 921 / 1336 against 660 / 886 / 1272
# µs) after the expert factor moved into the kernel, but its kernel alone also ran slower (210 against 202 µs at 8
# rows): the two variants interleaved in one run decide it (bench/moe.py --ffn-scale-ab).
source bench/device_env.sh
export JAX_PLATFORMS=cuda
mkdir -p $OUT/sub
OUT=$OUT/sub timeout 500 python3 bench/moe.py --no-ep --ffn-only --ffn-sizes routed --ffn-no-peers --ffn-rows 8,32,64 \
  --ffn-scale-ab 2>&1 | grep -E "A/B|tile layout [0-9]|ERROR|rror" | cut -c1-300
