"""MLA attention reference ops in plain jnp (docs/model.md §5): the naive per-head form and the absorbed latent form.

Masks are boolean `[B, T, S]` (True = attend). Softmax is float32; a row with no allowed key returns zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Products in true float32 on every platform (as pallas_kernels/kda/reference.py): on Hopper XLA's default f32 matmul
# precision is TF32 (~2^-11 relative per product), which is larger than the kernels' 1e-4 bar.
PRECISION = jax.lax.Precision.HIGHEST


def _einsum(*operands):
    return jnp.einsum(*operands, precision=PRECISION)


def _masked_softmax_stats(logits_bhts, mask_bts):
    logits = jnp.where(mask_bts[:, None], logits_bhts, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(logits - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    lse = jnp.where(denom > 0, jnp.log(jnp.where(denom > 0, denom, 1.0)) + m, -jnp.inf)[..., 0]
    # a row with no allowed key has denom 0: return zero weights (not 0/0 = NaN)
    return jnp.where(denom > 0, p / jnp.where(denom > 0, denom, 1.0), 0.0), lse


def attention(q_bthd, k_bshd, v_bshv, mask_bts, scale: float):
    """Dense multi-head attention. q `[B,T,H,d]`, k `[B,S,H,d]`, v `[B,S,H,dv]` -> o `[B,T,H,dv]` in v.dtype."""
    logits = _einsum("bthd,bshd->bhts", q_bthd.astype(jnp.float32), k_bshd.astype(jnp.float32)) * scale
    p, _ = _masked_softmax_stats(logits, mask_bts)
    return _einsum("bhts,bshv->bthv", p, v_bshv.astype(jnp.float32)).astype(v_bshv.dtype)


def absorbed(q_bthc, kv_bsc, mask_bts, scale: float, value_dim: int):
    """MQA over the latent cache: keys are the full rows `[latent | k_rope]` (c = R + rope), values the first
    `value_dim` (= R) columns. q `[B,T,H,c]` is the absorbed query `[q_nope·W_UK | q_rope]`.

    Returns (o_lat `[B,T,H,R]` float32, lse `[B,T,H]` float32) — the log-sum-exp lets partial results over
    disjoint key sets be merged exactly (decode context parallelism).
    """
    logits = _einsum("bthc,bsc->bhts", q_bthc.astype(jnp.float32), kv_bsc.astype(jnp.float32)) * scale
    p, lse_bht = _masked_softmax_stats(logits, mask_bts)
    o = _einsum("bhts,bsr->bthr", p, kv_bsc[..., :value_dim].astype(jnp.float32))
    return o, jnp.moveaxis(lse_bht, 1, 2)


def merge_partials(o_parts, lse_parts):
    """Merge attention outputs computed over disjoint key sets: o `[P, ..., R]`, lse `[P, ...]` -> (o, lse)."""
    lse = jax.nn.logsumexp(lse_parts, axis=0)
    w = jnp.exp(lse_parts - jnp.where(jnp.isfinite(lse), lse, 0.0))
    w = jnp.where(jnp.isfinite(lse_parts), w, 0.0)
    return jnp.sum(w[..., None] * o_parts, axis=0), lse


def online_softmax_init(B: int, T: int, H: int, value_dim: int):
    """The empty running state (max, sum, weighted values) of a float32 online softmax over key blocks."""
    return (jnp.full((B, T, H), -jnp.inf, jnp.float32), jnp.zeros((B, T, H), jnp.float32),
            jnp.zeros((B, T, H, value_dim), jnp.float32))


def online_softmax_step(carry, s_bthj, valid, weighted_values):
    """Fold one block of logits `[B, T, H, j]` (`valid` broadcastable to them; invalid keys add nothing) into the
    running state; `weighted_values(p) -> [B, T, H, R]` is the block's values weighted by p `[B, T, H, j]`."""
    m, l, acc = carry
    s = jnp.where(valid, s_bthj, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    m_use = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.where(valid, jnp.exp(s - m_use[..., None]), 0.0)
    corr = jnp.exp(m - m_use)  # m = −inf -> 0
    return m_new, l * corr + jnp.sum(p, axis=-1), acc * corr[..., None] + weighted_values(p)


def online_softmax_finish(carry):
    """(o `[B, T, H, R]`, lse `[B, T, H]`) of the running state; a query with no valid key gets o = 0, lse = −inf."""
    m, l, acc = carry
    o = acc / jnp.where(l > 0, l, 1.0)[..., None]
    lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
    return o, lse
