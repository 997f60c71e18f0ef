#!/usr/bin/env python3
"""Vision tower bench: the K3 MoonViT3d tower + projector (docs/model.md §9, `kimi_jax.modules.vision`) on one image,
bf16.

    python3 bench/vision.py [--sides 448,896,1792] [--smoke]

For each square image side (pixels; 1792 = 128 × 128 patches = 16384, the processor's patch budget) it times
`vision_features` (compiled once per grid) and reports ms per image, image tokens per second, and the achieved
TFLOP/s against a dense bf16 matmul measured in the same run (the ceiling the tower's projections could reach).
`--attention` picks the per-image attention: "fused" (cuDNN flash attention, the tower's default on a GPU),
"materialised" (float32 scores per chunk of 2048 queries, the CPU / float32 path) or "both" (each, same run). No bar in
BENCHMARKS.md: this is for information (how long an image prompt waits for its features).
`--path bucketed` times what the engine runs instead (`modules.vision_buckets.image_features`: the image padded to
its patch bucket, table taps / angles / merge indices made on the host, features brought back to the host), end to
end per image; "many" times `reps` images in one `images_features` call (as `Model.encode_images` runs a
request's images: every run started before the first result is fetched); "both" times exact and bucketed, "all" the
three. Sides whose patch count is not a bucket size (e.g. 1000 px: 5184 patches, bucket
6144) show the padding's cost.
`--smoke` runs a toy tower on the CPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from _timing import pipelined_seconds  # noqa: E402
from kimi_jax.config import VisionConfig  # noqa: E402
from kimi_jax.modules import vision as V  # noqa: E402
from kimi_jax.modules.vision import VisionTower, image_token_count, preprocess_image, vision_features  # noqa: E402
from kimi_jax.modules.vision_buckets import image_features, images_features  # noqa: E402


def tower_flops(cfg: VisionConfig, n_patches: int) -> float:
    """Matmul FLOPs of one image of n patches: qkv, wo, MLP per block; QKᵀ and PV over the image; merge projector."""
    D, Q, I = cfg.hidden_size, cfg.qkv_width, cfg.intermediate_size
    per_block = 2 * n_patches * (D * 3 * Q + Q * D + 2 * D * I) + 4 * n_patches * n_patches * Q
    merged = n_patches // cfg.merge ** 2
    projector = 2 * merged * (cfg.merged_width ** 2 + cfg.merged_width * cfg.text_hidden)
    return cfg.num_layers * per_block + 2 * n_patches * 3 * cfg.patch_size ** 2 * D + projector


def dense_tflops(reps: int) -> float:
    """A [8192, 4096] x [4096, 4096] bf16 matmul, f32 accumulation: the ceiling measured in this run."""
    a = jnp.ones((8192, 4096), jnp.bfloat16)
    b = jnp.ones((4096, 4096), jnp.bfloat16)
    f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    return 2 * 8192 * 4096 * 4096 / pipelined_seconds(f, a, b, reps=reps) / 1e12


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sides", default="448,896,1792", help="square image sides in pixels, comma-separated")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--attention", default="both", choices=("both", "fused", "materialised"),
                    help="per-image attention path(s) to time (fused needs a GPU; skipped elsewhere)")
    ap.add_argument("--path", default="exact", choices=("exact", "bucketed", "both", "many", "all"),
                    help="exact: vision_features (compiled per grid); bucketed: the engine's image_features, one "
                         "image per call; many: `reps` images per call (images_features, as Model.encode_images "
                         "runs a request's images); both: exact and bucketed; all: the three")
    ap.add_argument("--smoke", action="store_true", help="toy tower on the CPU (checks the script runs)")
    args = ap.parse_args()
    if args.smoke:
        cfg = VisionConfig(hidden_size=32, num_layers=2, num_heads=2, head_dim=16, intermediate_size=64, pos_table=8,
                           projector_hidden=128, text_hidden=64)
        sides, reps = [56, 112], 2
    else:
        cfg, sides, reps = VisionConfig(), [int(s) for s in args.sides.split(",")], args.reps
    print(f"jax {jax.__version__} {jax.devices()}", flush=True)
    tower = VisionTower(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    ceiling = dense_tflops(reps)
    print(f"dense bf16 matmul: {ceiling:.0f} TFLOP/s", flush=True)
    print("path, attention, side, patches, tokens, compile s, ms/image, tokens/s, TFLOP/s, of dense")
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (side, side, 3), dtype=np.uint8) for side in sides]
    default_choice = V.fused_attention_available
    paths = ("fused", "materialised") if args.attention == "both" else (args.attention,)
    for path in paths:
        if path == "fused" and not default_choice(jnp.bfloat16, cfg.head_dim):
            print("fused: not available here (needs a CUDA GPU and a 16-bit tower), skipped")
            continue
        V.fused_attention_available = (lambda *a, fused=(path == "fused"): fused)
        jax.clear_caches()  # `vision_features` compiled per grid: retrace with this path
        hows = {"both": ("exact", "bucketed"), "all": ("exact", "bucketed", "many")}.get(args.path, (args.path,))
        for how in hows:
            for side, image in zip(sides, images):
                patches, grid = preprocess_image(image, cfg)
                t0 = time.time()
                if how == "exact":
                    patches = jnp.asarray(patches)
                    jax.block_until_ready(vision_features(tower, patches, (grid,)))
                    compile_s = time.time() - t0
                    seconds = pipelined_seconds(lambda p: vision_features(tower, p, (grid,)), patches, reps=reps)
                else:  # the engine's path end to end (host arrays back), one image per call or `reps` in one
                    image_features(tower, patches, grid)
                    compile_s = time.time() - t0
                    t0 = time.perf_counter()
                    if how == "bucketed":  # each call waits for its features
                        for _ in range(reps):
                            image_features(tower, patches, grid)
                    else:  # every run started before the first result is fetched
                        images_features(tower, [(patches, grid)] * reps)
                    seconds = (time.perf_counter() - t0) / reps
                n = grid[1] * grid[2]
                tokens = image_token_count([grid], cfg.merge)
                tflops = tower_flops(cfg, n) / seconds / 1e12
                print(f"{how}, {path}, {side}, {n}, {tokens}, {compile_s:.1f}, {seconds * 1e3:.2f}, "
                      f"{tokens / seconds:.0f}, {tflops:.1f}, {tflops / ceiling:.2f}", flush=True)
    V.fused_attention_available = default_choice
    return 0


if __name__ == "__main__":
    sys.exit(main())
