# Session 28, call 5 (what was left of the device time). Vision: the engine's bucketed path and a request's images
# in one call ("many") beside the exact path, cuDNN attention, never timed on a GPU since session 23.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 230 python3 bench/vision.py --path all --attention fused --sides 448,1000,1792 --reps 3 2>&1 \
  | grep -v "^WARNING\|^I0000" | tail -14
