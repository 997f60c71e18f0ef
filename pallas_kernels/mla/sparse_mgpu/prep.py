"""XLA side of the Mosaic GPU sparse MLA decode: q prepared in the kernel's contraction order (`prepare_q`, f16 after
a per-head power-of-two normalisation; `prepare_q_fp8`: two e4m3 planes) and the slots (`prepare_slots`).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from pallas_kernels.moe.mgpu_mxfp4 import x_permutation
from pallas_kernels.gpu_prep import pow2_at_least
from pallas_kernels.moe.mxfp4 import split_e4m3_planes
from .config import HEADS, KEYS, LOG2E


def prepare_q(q_bhc, qscale):
    """q `[B, H, c]` (any float) and the logit scale (scale · layer scale) -> (q `[B, 16, c]` f16 in the kernel's
    contraction order, heads zero-padded; c2 `[B, 16]` f32: each head's power of two times log2 e, which turns the
    f16 dot back into log2-domain logits). The power of two is `gpu_prep.pow2_at_least` of the head's max |q|."""
    B, H, c = q_bhc.shape
    if H > HEADS:
        raise ValueError(f"the mgpu sparse MLA kernel takes ≤ {HEADS} heads per call, got {H}")
    q = q_bhc.astype(jnp.float32) * qscale
    s = pow2_at_least(jnp.max(jnp.abs(q), axis=-1))  # [B, H]
    q = (q / s[..., None])[..., jnp.asarray(x_permutation(c))]
    q = jnp.pad(q, ((0, 0), (0, HEADS - H), (0, 0))).astype(jnp.float16)
    c2 = jnp.pad(s * LOG2E, ((0, 0), (0, HEADS - H)), constant_values=LOG2E)
    return q, c2


def fp8_q_permutation(c: int) -> np.ndarray:
    """perm `[c]` for the fp8 logits: contraction column L reads stored column perm[L]. Thread t of a quad loads the
    16 bytes [64j + 16t, +16) of its key row; its word s is the WGMMA_8BIT register of 32-column group 2j + s // 2,
    block s % 2 (columns 16·(s % 2) + 4t .. + 3 of that group)."""
    L = np.arange(c)
    j, r = L // 64, L % 64
    s = 2 * (r // 32) + (r % 32) // 16
    return (64 * j + 16 * ((r % 16) // 4) + 4 * s + r % 4).astype(np.int32)


def prepare_q_fp8(q_bhc, qscale):
    """`prepare_q` for logits_mma="fp8": q `[B, H, c]` and the logit scale -> (q_hi, q_lo `[B, 16, c]` e4m3 in
    `fp8_q_permutation` order, heads zero-padded; c2 `[B, 16]` f32 = each head's 1/c (`split_e4m3_planes`) ·
    log2 e)."""
    B, H, c = q_bhc.shape
    if H > HEADS:
        raise ValueError(f"the mgpu sparse MLA kernel takes ≤ {HEADS} heads per call, got {H}")
    q = q_bhc.astype(jnp.float32)[..., jnp.asarray(fp8_q_permutation(c))] * qscale
    q = jnp.pad(q, ((0, 0), (0, HEADS - H), (0, 0)))
    hi, lo, inv = split_e4m3_planes(q.reshape(B * HEADS, c))
    return hi.reshape(B, HEADS, c), lo.reshape(B, HEADS, c), inv.reshape(B, HEADS) * LOG2E


def prepare_slots(idx_bk, splits: int, multiple: int = 1):
    """Top-k positions `[B, k]` -> `[B, splits, n_blk, 64]` int32 (−1 = empty), k padded with empty slots to
    splits · n_blk · 64 (n_blk a multiple of `multiple`: the kernel's warpgroups). The kernel maps them to pool rows
    through the block table itself (`pool_rows`' rule)."""
    B, k = idx_bk.shape
    n_blk = -(-k // (splits * KEYS))
    n_blk = -(-n_blk // multiple) * multiple
    idx = jnp.pad(jnp.asarray(idx_bk, jnp.int32), ((0, 0), (0, splits * n_blk * KEYS - k)), constant_values=-1)
    return idx.reshape(B, splits, n_blk, KEYS)


def _q_transforms():
    """q smem's layout when the kernel writes it (prep="kernel"): tiles of 8 heads × 64 columns, 128-byte swizzle
    (the inline code must address the tiles itself; with prep="xla" TMA fills q in the layout Mosaic infers)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu
    return (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


def _q_fp8_transforms():
    """q's e4m3 planes in smem (logits_mma="fp8"): tiles of 8 heads × 32 bytes, 32-byte swizzle — one tile row is
    one wgmma's K (as for x in `experimental.mxfp4_fp8_mma.kernel_call_fp8`)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu
    return (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(32))
