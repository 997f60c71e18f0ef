# Session 22, fourth call: s22_gpu3.sh's 64-row section spent its budget on the reference FFN (146 s) and timed only
# the default; here the 64-row default against gate, up and SiTU fused in the warp-specialised kernel.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
B="python3 bench/moe.py --no-ep --ffn-only --ffn-sizes routed --ffn-no-peers --ffn-bf16-gate-up"
F='MXFP4 FFN [0-9]+ rows/expert: tile|budget|copy band|reference ready|rror'
mkdir -p $OUT/r64
OUT=$OUT/r64 timeout 280 $B --ffn-rows 64 --budget 270 --ffn-configs '[{"gate_up":"fused"}]' 2>&1 | grep -E "$F" | cut -c1-420
