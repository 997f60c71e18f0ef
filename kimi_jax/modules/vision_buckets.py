"""The vision tower over images padded to a fixed set of patch counts, so a server compiles it a bounded number of
times instead of once per image size.

`vision.vision_features` takes the patch grid as a static argument: every distinct (h, w) compiles the whole tower
anew (tens of seconds on an accelerator, while every other request on the engine thread waits). Here one image of
L = h·w patches runs as the smallest bucket size L_b ≥ L of `patch_buckets` (powers of two and 1.5× between:
at most 1.5× the patches, ~17 sizes up to K3's 16,384), and everything that depends on (h, w) is an input computed
on the host:

* the position embedding `[L_b, D]`: the learned table resampled to (h, w) (`vision.resize_pos_table`'s math in
  float32 numpy), row-major, zeros past L;
* the RoPE angles `[L_b, head_dim/2]` (`vision.rope_angles`), zeros past L;
* the real patch count L: attention masks the padded keys (`vision.attention(kv_len=...)`), so real patches see
  exactly the image's patches; padded patches compute finite garbage that nothing reads;
* the 2×2 merge as indices `[M_b, merge²]` into the L_b patches (`vision.merge_patches`' order); the first
  M = (h/2)(w/2) rows of the result are the image's features.

The result equals `vision_features` up to float rounding (the softmax sums over masked zeros, the table resample
sums in another order). Video clips (t > 1) keep the exact path.
"""

from __future__ import annotations

import numpy as np
from flax import nnx

from kimi_jax.config import VisionConfig
from kimi_jax.modules.vision import VisionInputError, VisionTower, _axis_resize_matrix, rope_angles

MIN_BUCKET = 64  # patches: smaller images pad to this (a 112×112-pixel image is 64 patches)


def bucket_for(num_patches: int, cfg: VisionConfig) -> int:
    """The patch count an image of `num_patches` is padded to: the smallest 2^k or 3·2^(k−1) ≥ it (and ≥
    MIN_BUCKET), rounded up to a multiple of merge²."""
    unit, p = cfg.merge * cfg.merge, MIN_BUCKET
    while p < num_patches and 3 * p // 2 < num_patches:
        p *= 2
    size = p if p >= num_patches else 3 * p // 2
    return -(-size // unit) * unit


def patch_buckets(cfg: VisionConfig) -> tuple[int, ...]:
    """Every bucket size an image `preprocess_image` makes can take (up to max_patches plus a padded row and
    column of merge blocks): the tower's compiles are at most this many."""
    side = cfg.max_patches_per_side + cfg.merge
    largest = min(side * side, cfg.max_patches + 2 * cfg.merge * side + cfg.merge * cfg.merge)
    sizes, n = [], MIN_BUCKET
    while not sizes or sizes[-1] < largest:
        sizes.append(bucket_for(n, cfg))
        n = sizes[-1] + 1
    return tuple(sizes)


def host_inputs(tower: VisionTower, h: int, w: int, size: int):
    """(position embedding `[size, D]` float32, RoPE angles `[size, head_dim/2]` float32, merge indices
    `[size / merge², merge²]` int32) of an (h, w)-patch image padded to `size` patches."""
    cfg = tower.cfg
    L, m = h * w, cfg.merge
    table = np.asarray(tower.pos_emb[...], np.float32)  # [S, S, D]
    a_h = _axis_resize_matrix(h, table.shape[0], cfg.pos_resize).astype(np.float32)
    a_w = _axis_resize_matrix(w, table.shape[1], cfg.pos_resize).astype(np.float32)
    pos = np.zeros((size, table.shape[2]), np.float32)
    pos[:L] = np.einsum("wj,hjd->hwd", a_w, np.einsum("hi,ijd->hjd", a_h, table)).reshape(L, -1)
    angles = np.zeros((size, cfg.head_dim // 2), np.float32)
    angles[:L] = rope_angles(h, w, cfg.head_dim, cfg.rope_theta)
    # merged token (R, C) holds patches (R·m + a, C·m + b), a, b < m, row-major within the block
    R, C, a, b = np.meshgrid(np.arange(h // m), np.arange(w // m), np.arange(m), np.arange(m), indexing="ij")
    idx = ((R * m + a) * w + (C * m + b)).reshape((h // m) * (w // m), m * m)
    merge = np.zeros((size // (m * m), m * m), np.int32)
    merge[:len(idx)] = idx
    return pos, angles, merge


@nnx.jit
def _features_padded_jit(tower: VisionTower, x_LP, pos_LD, angle_Lp, kv_len, merge_Mk):
    return tower.features_padded(x_LP, pos_LD, angle_Lp, kv_len, merge_Mk)


def image_features(tower: VisionTower, patches, grid_thw) -> np.ndarray:
    """`vision.vision_features(tower, patches, (grid_thw,))` for one image (t = 1), compiled once per bucket
    size instead of once per grid: patches `[h·w, 3, p, p]` or `[h·w, 3·p·p]` -> features `[(h/m)(w/m),
    text_hidden]` (numpy, the parameters' dtype; cut to the image's rows on the host, where a slice compiles
    nothing)."""
    t, h, w = (int(v) for v in grid_thw)
    cfg = tower.cfg
    if t != 1:
        raise VisionInputError(f"bucketed image features take one frame, got grid {grid_thw}: use vision_features")
    if h < 1 or w < 1 or h % cfg.merge or w % cfg.merge:
        raise VisionInputError(f"grid h, w = {h}, {w} must be positive multiples of the merge size {cfg.merge}")
    L, P = h * w, 3 * cfg.patch_size ** 2
    x = np.asarray(patches, np.float32)
    if x.shape[0] != L or x.size != L * P:
        raise VisionInputError(f"patches of shape {x.shape} do not fit grid {(t, h, w)}: expected [{L}, {P}]")
    size = bucket_for(L, cfg)
    x_LP = np.zeros((size, P), np.float32)
    x_LP[:L] = x.reshape(L, P)
    pos, angles, merge = host_inputs(tower, h, w, size)
    out = _features_padded_jit(tower, x_LP, pos, angles, np.int32(L), merge)
    return np.asarray(out)[:(h // cfg.merge) * (w // cfg.merge)]
