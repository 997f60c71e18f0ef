"""Quantised weight formats found in checkpoints, with exact NumPy (de)quantisation.

* FP8 block (DeepSeek-V3.x): `weight` float8_e4m3fn `[out, in]` and `weight_scale_inv` float32
  `[ceil(out/bo), ceil(in/bi)]` (block 128x128); value = weight * scale_inv of its block.
* MXFP4 (Kimi K3 routed experts, compressed-tensors `mxfp4-pack-quantized`): `weight_packed` uint8 `[out, in/2]`,
  two e2m1 codes per byte, the LOW nibble holding the even element; `weight_scale` uint8 E8M0 `[out, in/32]`,
  value = e2m1 * 2^(e - 127) (e = 255 is NaN).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from pallas_kernels.codec import E2M1_VALUES, MXFP4_GROUP, mxfp4_decode, mxfp4_encode  # noqa: F401  (one codec)

from .errors import ConvertError

FP8_BLOCK = (128, 128)
FP8_MAX = 448.0


def fp8_scale_shape(shape, block=FP8_BLOCK) -> tuple:
    """Scale grid of a `[..., out, in]` FP8 weight."""
    *lead, rows, cols = shape
    return tuple(lead) + (-(-rows // block[0]), -(-cols // block[1]))


def _expand_blocks(scale, rows, cols, block):
    s = np.repeat(np.repeat(scale, block[0], axis=-2), block[1], axis=-1)
    return s[..., :rows, :cols]


def fp8_dequant(weight, scale_inv, block=FP8_BLOCK, out_dtype=np.float32, name: str = "") -> np.ndarray:
    """`[..., out, in]` FP8 weight times its per-block scale -> out_dtype (math in float32)."""
    rows, cols = weight.shape[-2:]
    if tuple(scale_inv.shape) != fp8_scale_shape(weight.shape, block):
        raise ConvertError(f"shape mismatch for {name or 'weight'}_scale_inv: expected "
                           f"{list(fp8_scale_shape(weight.shape, block))} for a {list(weight.shape)} weight with "
                           f"{block[0]}x{block[1]} blocks, found {list(scale_inv.shape)}")
    w = np.asarray(weight).astype(np.float32)
    w *= _expand_blocks(np.asarray(scale_inv, np.float32), rows, cols, block)
    return w.astype(out_dtype, copy=False)


def fp8_quant(w, block=FP8_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """Block-quantise `[..., out, in]` to (float8_e4m3fn weight, float32 scale_inv), scale = amax / 448."""
    w = np.asarray(w, np.float32)
    rows, cols = w.shape[-2:]
    pr, pc = -rows % block[0], -cols % block[1]
    pad = [(0, 0)] * (w.ndim - 2) + [(0, pr), (0, pc)]
    wp = np.pad(np.abs(w), pad)
    g = wp.reshape(*w.shape[:-2], (rows + pr) // block[0], block[0], (cols + pc) // block[1], block[1])
    amax = g.max(axis=(-3, -1))
    scale = np.where(amax > 0, amax / FP8_MAX, 1.0).astype(np.float32)
    q = np.clip(w / _expand_blocks(scale, rows, cols, block), -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    return q, scale


def mxfp4_dequant(packed, scale, out_dtype=np.float32, name: str = "") -> np.ndarray:
    """`[..., out, in/2]` packed codes and `[..., out, in/32]` E8M0 scales -> `[..., out, in]` values."""
    packed = np.asarray(packed)
    scale = np.asarray(scale)
    if scale.dtype != np.uint8:
        scale = scale.view(np.uint8)
    cols = packed.shape[-1] * 2
    if packed.dtype != np.uint8 or scale.shape != packed.shape[:-1] + (cols // MXFP4_GROUP,) or cols % MXFP4_GROUP:
        raise ConvertError(f"MXFP4 tensors of {name or 'weight'} do not fit: packed {packed.dtype} "
                           f"{list(packed.shape)}, scale {list(scale.shape)} (expected [..., in/2] uint8 and "
                           f"[..., in/{MXFP4_GROUP}])")
    return mxfp4_decode(packed, scale).astype(out_dtype, copy=False)


def mxfp4_quant(w) -> tuple[np.ndarray, np.ndarray]:
    """Quantise `[..., out, in]` to MXFP4 (packed uint8 `[..., out, in/2]`, E8M0 uint8 `[..., out, in/32]`;
    `pallas_kernels.codec.mxfp4_encode`). Used to build synthetic checkpoints."""
    cols = np.shape(w)[-1]
    if cols % MXFP4_GROUP:
        raise ConvertError(f"MXFP4 needs the input dimension to be a multiple of {MXFP4_GROUP}, got {cols}")
    return mxfp4_encode(w)
