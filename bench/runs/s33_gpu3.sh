# Session 33, call 3. The draft model now drafts for every running sequence in one batch (propose_batch): call 1's
# bench again (kimi-k3.1-reduced drafting for itself, 1 and 4 sequences, temperature 1, greedy and sampled drafts),
# where the unbatched draft model gave 0.50x at 4 sequences verifying always. Re-run (call 4) after the drafting rows
# were packed into power-of-two batches: call 3 ran every proposal at batch 4, which cost 1 sequence 1.00x -> 0.82x.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
mkdir -p $OUT/sub
OUT=$OUT/sub timeout 420 python3 bench/spec_decode.py --gpu --max-tokens 96 --max-num-seqs 4 \
  --scenarios draft,draft-sampled --temperature 1.0 2>&1 | grep -v "^WARNING\|^I0000" | grep -E "^draft|^#"
