# Session 24 call 1: session 23's unrun s23_gpu7.sh (FFN with down at W = 4 via MgpuConfig.down_config, ± decode_pieces;
# device tests of the tile-layout FFN first), then the vision tower exact vs bucketed (engine path) per image side.
bash bench/runs/s23_gpu7.sh
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 150 python3 bench/vision.py --path both --attention fused --sides 448,1000,1792 --reps 5 2>&1 | tail -12
