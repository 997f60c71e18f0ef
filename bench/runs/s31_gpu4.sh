# Session 31, call 4. Issue #6: the model's MoE path under Nsight Compute at 32 / 64 rows per expert with the dispatch
# plan ranked by counting (`ops.sort_tokens`, P² compares; call 3: the one-key sort 30.9 µs, argsort 31.9 in
# call 1), then the path timed (bench/moe.py --ffn-from-tokens).
# The same commands as call 3.
exec bash bench/runs/s31_gpu3.sh
