"""DSA lightning-indexer reference ops in plain jnp (docs/model.md §6).

score[b,t,s] = Σ_h w[b,t,h] · relu(q[b,t,h]·k[b,s])   (the caller folds Hi^-0.5 · d^-0.5 into w)
Top-k keeps, per query, the k highest-scoring allowed keys; all allowed keys when there are at most k.
Tie rule: among equal scores the earlier position wins (`jax.lax.top_k` keeps the lower index first).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Products in true float32 on every platform (as pallas_kernels/kda/reference.py): on Hopper XLA's default f32 matmul
# precision is TF32 (~2^-11 relative per product), which is larger than the kernels' 1e-5 score bar.
PRECISION = jax.lax.Precision.HIGHEST


def scores(q_bthd, k_bsd, w_bth, allowed_bts):
    """Index scores `[B, T, S]` float32, −inf where not allowed (future or beyond the cache)."""
    dots = jnp.einsum("bthd,bsd->bths", q_bthd.astype(jnp.float32), k_bsd.astype(jnp.float32), precision=PRECISION)
    s = jnp.einsum("bth,bths->bts", w_bth.astype(jnp.float32), jax.nn.relu(dots), precision=PRECISION)
    return jnp.where(allowed_bts, s, -jnp.inf)


def topk_mask(scores_bts, allowed_bts, topk: int):
    """Boolean keep-mask `[B, T, S]`: the top-k allowed keys of each query row."""
    S = scores_bts.shape[-1]
    if S <= topk:
        return allowed_bts
    # map -0.0 to +0.0: top_k orders by a total order in which -0.0 < +0.0, which would break the
    # "equal scores: earlier position wins" rule
    _, idx_btk = jax.lax.top_k(jnp.where(scores_bts == 0, 0.0, scores_bts), topk)
    keep = jnp.zeros(scores_bts.shape, bool)
    b, t = jnp.meshgrid(jnp.arange(scores_bts.shape[0]), jnp.arange(scores_bts.shape[1]), indexing="ij")
    keep = keep.at[b[..., None], t[..., None], idx_btk].set(True)
    return keep & allowed_bts
