"""A request's images inside the engine: where their tokens sit, their features, and what the prefix cache keys on.

A prompt with images carries, for image i, ``counts[i]`` ``<|media_pad|>`` tokens (``modules.vision``'s
``expand_image_pads``; the chat encoder writes them so).  The engine:

* at ``submit`` checks the images against the pads (``PromptImages.create``: uint8 RGB arrays, one pad per image
  token, images in order of their pads) and digests each image's pixels;
* before admission has the tower's programs for its images' patch buckets compiled (``ready``: in a background
  thread, ``modules.vision_buckets.BucketPrograms.prepare``; the request waits at the head of the queue meanwhile
  while running sequences keep decoding -- a new image size no longer stalls every stream for a tower compile);
* at admission runs the vision tower once (``encode``: ``Model.encode_images``, on the engine thread, which owns the
  device; ``encode_many`` takes the images of the requests waiting behind it too, when their programs are
  compiled, so their tower runs overlap) and keeps the features ``[N, D]`` for the request's lifetime, so a
  preempted sequence's recompute feeds the same features again;
* for each prefill chunk ``[start, start + C)`` that holds image tokens hands the runner ``chunk_inputs`` --
  features ``[1, C, D]`` with the image rows in place and a mask ``[1, C]`` -- so a chunk may begin or end anywhere
  inside an image;
* keys the prefix cache by ``cache_key(ids)``: the token ids with every image token replaced by
  ``(pixel digest, token index within the image)``, so two prompts whose ids agree but whose images differ part ways
  at the first image token and never share pages or a checkpoint past it, while identical images do share.

Image tokens must all be prefilled (the decode step reads token embeddings only): ``Engine.submit`` refuses a
prompt whose image tokens would ride the decode steps (possible only when 1 is not among the prefill chunk sizes).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from ..modules.vision import image_token_count, navit_size
from ..modules.vision_buckets import bucket_for, programs_for
from .sampling_params import ParamError

DIGEST_BYTES = 16


def image_digest(image_hw3: np.ndarray) -> bytes:
    """blake2b of the pixels and the shape: equal only for identical images."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    h.update(np.asarray(image_hw3.shape, np.int64).tobytes())
    h.update(np.ascontiguousarray(image_hw3).tobytes())
    return h.digest()


@dataclass(eq=False)
class PromptImages:
    """The images of one prompt.  ``positions``: int64 ``[N]``, ascending, the prompt positions of the ``N`` image
    tokens (image after image); ``counts[i]``: tokens of image i; ``features``: ``[N, D]`` in the model's activation
    dtype once ``encode`` ran (None before)."""

    images: Optional[list]  # uint8 [H, W, 3] each; dropped once encoded
    positions: np.ndarray
    counts: tuple[int, ...]
    digests: tuple[bytes, ...]
    patches: tuple[int, ...] = ()  # patches of image i after preprocessing (h·w of its padded grid)
    features: Optional[np.ndarray] = None
    _key_items: list = field(default_factory=list)  # the cache-key element of each image token, in order

    @property
    def end(self) -> int:
        """One past the last image token's position: prefill must cover ``[0, end)``."""
        return int(self.positions[-1]) + 1

    @classmethod
    def create(cls, ids: Sequence[int], images: Sequence[np.ndarray], vision_cfg) -> "PromptImages":
        """Check ``images`` against the prompt ``ids`` (``ParamError`` naming the problem) and digest them."""
        pad_id = vision_cfg.image_token_id
        counts, arrays, patches = [], [], []
        for i, img in enumerate(images):
            arr = np.asarray(img)
            if arr.ndim != 3 or arr.shape[2] != 3 or arr.dtype != np.uint8 or min(arr.shape[:2]) < 1:
                raise ParamError(f"image {i} must be a uint8 RGB array [H, W, 3], got {arr.dtype} {arr.shape}",
                                 "images")
            _, (pad_h, pad_w) = navit_size(arr.shape[0], arr.shape[1], vision_cfg)
            p = vision_cfg.patch_size
            counts.append(image_token_count([(1, pad_h // p, pad_w // p)], vision_cfg.merge))
            patches.append((pad_h // p) * (pad_w // p))
            arrays.append(arr)
        positions = np.flatnonzero(np.asarray(ids) == pad_id)
        if len(positions) != sum(counts):
            raise ParamError(f"the prompt holds {len(positions)} <|media_pad|> tokens (id {pad_id}) but its "
                             f"{len(counts)} image(s) need {sum(counts)} ({', '.join(map(str, counts))}): expand "
                             "each image's placeholder to its token count", "images")
        digests = tuple(image_digest(a) for a in arrays)
        items = [(d, k) for d, n in zip(digests, counts) for k in range(n)]
        return cls(arrays, positions, tuple(counts), digests, tuple(patches), _key_items=items)

    def ready(self, model) -> bool:
        """Whether the tower's programs for these images are compiled; starts their compiles in the background
        when not (``BucketPrograms.prepare``; a failed compile raises here). True once encoded."""
        if self.features is not None:
            return True
        return programs_for(model.vision).prepare(self.buckets(model.config.vision))

    def buckets(self, vision_cfg) -> list[int]:
        """The patch-count buckets (`modules.vision_buckets.bucket_for`) these images run in, ascending."""
        return sorted({bucket_for(n, vision_cfg) for n in self.patches})

    def encode(self, model) -> None:
        """Run the vision tower once (``Model.encode_images``); keeps ``features [N, D]`` and drops the pixels."""
        encode_many([self], model)

    def chunk_inputs(self, start: int, size: int) -> Optional[tuple[np.ndarray, np.ndarray]]:
        """(features ``[1, size, D]``, mask bool ``[1, size]``) for the prefill chunk at prompt positions
        ``[start, start + size)``; None when it holds no image token (the text-only program then runs it)."""
        lo, hi = np.searchsorted(self.positions, [start, start + size])
        if lo == hi:
            return None
        feats = np.zeros((1, size, self.features.shape[1]), self.features.dtype)
        mask = np.zeros((1, size), bool)
        rel = self.positions[lo:hi] - start
        feats[0, rel] = self.features[lo:hi]
        mask[0, rel] = True
        return feats, mask

    def cache_key(self, ids: Sequence[int]) -> list:
        """``ids`` (the prompt, possibly + generated tokens) with each image token replaced by its
        ``(digest, index)`` item: the prefix cache's key."""
        key = list(ids)
        for pos, item in zip(self.positions.tolist(), self._key_items):
            key[pos] = item
        return key


def encode_many(prompts: Sequence[PromptImages], model) -> None:
    """``encode`` for several prompts' images in one ``Model.encode_images`` call: every image's tower run starts
    before the first one's features come back, across requests as within one (on a GPU, one image's host work and
    transfers then overlap the others' device time).  Prompts already encoded are skipped; nothing is kept unless
    every image encoded."""
    todo = [p for p in prompts if p.features is None]
    if not todo:
        return
    feats = model.encode_images([img for p in todo for img in p.images])
    bounds = np.cumsum([0] + [len(p.counts) for p in todo])
    if len(feats) != bounds[-1]:
        raise RuntimeError(f"vision tower gave features for {len(feats)} images, {bounds[-1]} were sent")
    parts = [feats[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    for p, part in zip(todo, parts):
        got = tuple(int(f.shape[0]) for f in part)
        if got != p.counts:  # the tower and the prompt disagree on the token counts: a bug, not a bad request
            raise RuntimeError(f"vision tower gave {got} tokens per image, the prompt holds {p.counts}")
    for p, part in zip(todo, parts):
        p.features = np.concatenate([np.asarray(f) for f in part], axis=0)
        p.images = None
