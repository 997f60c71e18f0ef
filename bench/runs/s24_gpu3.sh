# Session 24 call 3: the vision tower's three paths: exact (device time per grid), bucketed (one image per call, end
# to end), many (8 images per images_features call: every run started before the first result is fetched).
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 200 python3 bench/vision.py --path all --attention fused --sides 448,1000,1792 --reps 8 2>&1 | tail -11
