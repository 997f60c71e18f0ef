# Next GPU run (written in session 21, not yet run): the warp-specialised MXFP4 kernel (MgpuConfig(warpgroups=2):
# two compute warpgroups sharing each x tile, a memory warpgroup issuing the copies, each CTA's work items one chain
# of pipelines) — first its device tests, then the expert FFN at 8, 32 and 64 rows per expert against the defaults
# in the same run. The bench spends ≈ 150 s on setup (weights, reference FFN) before its first timing.
source bench/device_env.sh
export JAX_PLATFORMS=cuda
timeout 200 python3 -m pytest -q -x -m gpu tests/test_moe_kernels.py -k "warp_specialised" 2>&1 | tail -3
B="python3 bench/moe.py --no-ep --ffn-only --ffn-sizes routed --ffn-no-peers"
F='MXFP4 FFN [0-9]+ rows/expert: tile|budget|copy band|FFN weights|reference ready'
W='"warpgroups":2,"ctas_per_sm":1'
OUT=$OUT/r8 timeout 330 $B --ffn-rows 8 --budget 310 --ffn-configs \
  "[{$W,\"rows\":16,\"kh\":128,\"steps\":7},{$W,\"rows\":16,\"kh\":64,\"steps\":4},{\"warpgroups\":4,\"ctas_per_sm\":1,\"rows\":16,\"kh\":128,\"steps\":7}]" \
  2>&1 | grep -E "$F" | cut -c1-400
# then, in a second call: --ffn-rows 32 with {$W,"rows":40,"kh":64,"steps":7}, --ffn-rows 64 with {$W,"rows":80,"kh":64,"steps":4}
