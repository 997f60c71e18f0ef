# Session 20, call 2: call 1's MoE bench ran out of its budget in the per-matmul and Triton rows before the tile
# layout's; again with room. Then the sparse MLA op and its gather alone at B = 128 beside B = 32 (does the
# fraction of copy grow with the bytes per call?).
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 330 python3 bench/moe.py --no-ep --ffn-only --ffn-rows 8 --ffn-sizes routed --budget 320 > $OUT/moe.txt 2>&1
echo "moe rc=$?"; grep -E "FFN|copy|FAIL|pass|Error" $OUT/moe.txt | tail -14
timeout 110 python3 bench/mla_gather_probe.py --batch 128 --configs '[{}, {"issue": "lsu"}]' 2>&1 | grep -v Warn | tail -4
timeout 140 python3 bench/mla_mgpu.py --ops op --batches 32,128 --no-triton 2>&1 | grep -v Warn | tail -6
