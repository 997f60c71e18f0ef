# Session 19, call 1: session 18's fused gate/up kernel (MgpuConfig(gate_up="fused")) has never run on a GPU — its
# tests first, then the FFN bench at 8 rows per expert (decode) and 146 (a 16K-token prefill) with both fused configs
# that fit shared memory, next to the Triton kernel on the checkpoint layout (does the tile layout lose at prefill?).
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 200 python3 -m pytest -q -m gpu tests/test_moe_kernels.py -k "tiled or model_runs" --tb=short -p no:cacheprovider > $OUT/moe_tests.txt 2>&1
echo "moe gpu tests rc=$?: $(grep -E '[0-9]+ (passed|failed)' $OUT/moe_tests.txt | tail -1)"
grep -E "^FAILED|^E  " $OUT/moe_tests.txt | head -12
timeout 330 python3 bench/moe.py --no-ep --ffn-only --ffn-rows 8,146 --ffn-sizes routed --budget 300 \
  --ffn-configs '[{"gate_up": "fused", "kh": 128}, {"gate_up": "fused", "ctas_per_sm": 2}]' > $OUT/ffn.txt 2>&1
echo "ffn rc=$?"
grep -E "FFN|Error|FAILED|copy|tile layout|Triton|per-matmul|fused|kernel" $OUT/ffn.txt | cut -c1-400
