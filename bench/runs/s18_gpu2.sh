# Session 18, call 2: call 1's FFN used uniform-cut group sizes (max far above 8: 8-row tiles stream a skewed expert's
# weights several times). Now group sizes as a balanced router gives them (multinomial, --ffn-sizes routed) and the
# tile layout with 8- and 16-row tiles; then the skewed sizes once more for the record.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 300 python3 bench/moe.py --no-ep --ffn-only --ffn-rows 8,32 --ffn-sizes routed --budget 290 --ffn-configs '[{"rows": 16, "ctas_per_sm": 4}, {"rows": 16, "ctas_per_sm": 3, "kh": 256, "steps": 2}]' 2>&1 | grep -E "FFN|Error|FAILED|copy|tile layout" | cut -c1-400
timeout 150 python3 bench/moe.py --no-ep --ffn-only --ffn-rows 8 --ffn-sizes cuts --budget 140 --ffn-configs '[{"rows": 16, "ctas_per_sm": 4}]' 2>&1 | grep -E "FFN|Error|FAILED|tile layout" | cut -c1-400
