"""The vision tower over images padded to a fixed set of patch counts, so a server compiles it a bounded number of
times instead of once per image size.

`vision.vision_features` takes the patch grid as a static argument: every distinct (h, w) compiles the whole tower
anew (tens of seconds on an accelerator, while every other request on the engine thread waits). Here one image of
L = h·w patches runs as the smallest bucket size L_b ≥ L of `patch_buckets` (powers of two and 1.5× between:
at most 1.5× the patches, 18 sizes for K3's images), and everything that depends on (h, w) is an input computed
on the host:

* each patch's position-table taps (`vision.axis_resize_taps` of its row and column, zero weight past L): the
  device resamples the learned table from them (`vision.gather_pos_table`, K² row gathers). Resampling on the host
  instead was 3 GFLOP of numpy per 16K-patch image (H200 host: 596 ms per image end to end against
  144 ms now and 107 for the exact path's device time; 58 → 8 ms at 1K patches);
* the RoPE angles `[L_b, head_dim/2]` (`vision.rope_angles`), zeros past L;
* the real patch count L: attention masks the padded keys (`vision.attention(kv_len=...)`), so real patches see
  exactly the image's patches; padded patches compute finite garbage that nothing reads;
* the 2×2 merge as indices `[M_b, merge²]` into the L_b patches (`vision.merge_patches`' order); the first
  M = (h/2)(w/2) rows of the result are the image's features.

The result equals `vision_features` up to float rounding (the softmax sums over masked zeros, the table resample
sums in another order). Video clips (t > 1) keep the exact path.
"""

from __future__ import annotations

import functools
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import jax
import numpy as np
from flax import nnx

from kimi_jax.config import VisionConfig
from kimi_jax.modules.vision import VisionInputError, VisionTower, axis_resize_taps, check_grid, rope_angles

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


@functools.lru_cache(maxsize=64)  # a server sees the same few grids again and again; the arrays are read-only
def host_inputs(cfg: VisionConfig, h: int, w: int, size: int):
    """(position-table taps (row index, row weight, column index, column weight), each `[size, K]` int32 /
    float32 — `vision.gather_pos_table` resamples the table from them on the device; RoPE angles
    `[size, head_dim/2]` float32; merge indices `[size / merge², merge²]` int32) of an (h, w)-patch image padded
    to `size` patches. Padded patches get taps of weight 0 and angle 0. Cached per (cfg, h, w, size)."""
    L, m, S = h * w, cfg.merge, cfg.pos_table
    rows, cols = np.divmod(np.arange(L), w)  # patch l sits at (l // w, l % w), row-major
    taps = []
    for n, at in ((h, rows), (w, cols)):
        index_nK, weight_nK = axis_resize_taps(n, S, cfg.pos_resize)
        index = np.zeros((size, index_nK.shape[1]), np.int32)
        weight = np.zeros((size, index_nK.shape[1]), np.float32)
        index[:L], weight[:L] = index_nK[at], weight_nK[at]
        taps += [index, weight]
    angles = np.zeros((size, cfg.head_dim // 2), np.float32)
    angles[:L] = rope_angles(h, w, cfg.head_dim, cfg.rope_theta)
    # merged token (R, C) holds patches (R·m + a, C·m + b), a, b < m, row-major within the block
    R, C, a, b = np.meshgrid(np.arange(h // m), np.arange(w // m), np.arange(m), np.arange(m), indexing="ij")
    idx = ((R * m + a) * w + (C * m + b)).reshape((h // m) * (w // m), m * m)
    merge = np.zeros((size // (m * m), m * m), np.int32)
    merge[:len(idx)] = idx
    for arr in (*taps, angles, merge):
        arr.setflags(write=False)
    return tuple(taps), angles, merge


class BucketPrograms:
    """One tower's bucketed programs: `features` runs an image (compiling its bucket on first use, in the calling
    thread), `prepare` compiles buckets ahead of use in a background thread, so that a server's engine thread can
    keep decoding while a new image size's bucket compiles instead of stalling every stream on it.

    The tower's parameters are taken once (`nnx.split`) and passed to one `jax.jit` of a pure function, which is
    safe to call from several threads at once; the background thread compiles a bucket by running it once on a
    blank image, which fills the same jit cache the calls then hit."""

    def __init__(self, tower: VisionTower):
        self.cfg = tower.cfg  # the tower itself is not kept: `programs_for` caches by a weak reference to it
        # patches cross to the device as float32 and are rounded to the tower's dtype there (`features_padded`'s
        # first step; XLA rounds to nearest even as numpy's bf16 does, so the bits are the same). Rounding on the
        # host cost more than the bytes it saves: numpy's float32 -> bf16 of a 1792-px image's 19M values takes
        # ~45 ms (a float32 pad ~18 ms) on a 2-core host, against ~2-4 ms for the 38 MB more over PCIe; on the H200
        # the bucketed path took 136.5 ms per 1792-px image against 104.8 for the exact one
        self._patch_dtype = np.dtype(np.float32)
        graphdef, self._state = nnx.split(tower)

        def run(state, x_LP, pos_taps, angle_Lp, kv_len, merge_Mk):
            return nnx.merge(graphdef, state).features_padded(x_LP, pos_taps, angle_Lp, kv_len, merge_Mk)

        self._run = jax.jit(run)
        self._lock = threading.Lock()
        self._compiles: dict[int, Future] = {}  # bucket size -> its background compile
        self._pool: ThreadPoolExecutor | None = None

    def _call(self, x_LP, h: int, w: int):
        pos_taps, angles, merge = host_inputs(self.cfg, h, w, x_LP.shape[0])
        return self._run(self._state, x_LP, pos_taps, angles, np.int32(h * w), merge)

    def _warm(self, size: int) -> None:
        m = self.cfg.merge
        jax.block_until_ready(self._call(np.zeros((size, 3 * self.cfg.patch_size ** 2), self._patch_dtype), m, m))

    def prepare(self, sizes) -> bool:
        """Start compiling the bucket `sizes` not compiled or compiling yet (one background thread, in order);
        True when every one of them is compiled. A failed compile is re-raised here."""
        with self._lock:
            futures = []
            for size in sorted(set(int(v) for v in sizes)):
                if size not in self._compiles:
                    if self._pool is None:
                        self._pool = ThreadPoolExecutor(1, thread_name_prefix="vision-compile")
                    self._compiles[size] = self._pool.submit(self._warm, size)
                futures.append(self._compiles[size])
        for f in futures:
            if f.done() and f.exception() is not None:
                raise f.exception()
        return all(f.done() for f in futures)

    def _padded(self, patches, grid_thw):
        """One image checked and padded to its bucket -> (patches `[L_b, 3·p·p]` in the tower's dtype, h, w)."""
        cfg = self.cfg
        ((t, h, w),) = check_grid(cfg, [grid_thw])  # positive, h and w whole merge blocks
        if t != 1:
            raise VisionInputError(f"bucketed image features take one frame, got grid {grid_thw}: use "
                                   "vision_features")
        L, P = h * w, 3 * cfg.patch_size ** 2
        x = np.asarray(patches, np.float32)
        if x.shape[0] != L or x.size != L * P:
            raise VisionInputError(f"patches of shape {x.shape} do not fit grid {(t, h, w)}: expected [{L}, {P}]")
        size = bucket_for(L, cfg)
        if size == L:  # the image fills its bucket: no host copy at all
            return x.reshape(L, P), h, w
        x_LP = np.zeros((size, P), self._patch_dtype)
        x_LP[:L] = x.reshape(L, P)
        return x_LP, h, w

    def features_many(self, images) -> list[np.ndarray]:
        """Several images (t = 1), each (patches, grid_thw) as `features` takes them -> their features in order.
        Every image's program is started before the first result is fetched, so one image's host work and
        transfers overlap the previous ones' device time. Every image is checked before any runs."""
        padded = [self._padded(patches, grid) for patches, grid in images]
        runs = [(self._call(x_LP, h, w), (h // self.cfg.merge) * (w // self.cfg.merge)) for x_LP, h, w in padded]
        return [np.asarray(feats)[:M] for feats, M in runs]  # cut on the host, where a slice compiles nothing

    def features(self, patches, grid_thw) -> np.ndarray:
        """One image (t = 1): patches `[h·w, 3, p, p]` or `[h·w, 3·p·p]` -> features `[(h/m)(w/m), text_hidden]`
        (numpy, the parameters' dtype)."""
        return self.features_many([(patches, grid_thw)])[0]


_PROGRAMS: "weakref.WeakKeyDictionary[VisionTower, BucketPrograms]" = weakref.WeakKeyDictionary()
_PROGRAMS_LOCK = threading.Lock()


def programs_for(tower: VisionTower) -> BucketPrograms:
    """The tower's `BucketPrograms` (one per tower, kept while the tower lives)."""
    with _PROGRAMS_LOCK:
        if tower not in _PROGRAMS:
            _PROGRAMS[tower] = BucketPrograms(tower)
        return _PROGRAMS[tower]


def images_features(tower: VisionTower, images) -> list[np.ndarray]:
    """`image_features` of several images, (patches, grid_thw) each, their programs started back to back
    (`BucketPrograms.features_many`)."""
    return programs_for(tower).features_many(images)


def image_features(tower: VisionTower, patches, grid_thw) -> np.ndarray:
    """`vision.vision_features(tower, patches, (grid_thw,))` for one image (t = 1), compiled once per bucket
    size instead of once per grid (`BucketPrograms.features`)."""
    return programs_for(tower).features(patches, grid_thw)
