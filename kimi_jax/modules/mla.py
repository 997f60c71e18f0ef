"""Gated NoPE MLA (K3) and RoPE MLA (DeepSeek), with the DSA lightning indexer (SPEC §5–6).

The cache holds, per token, the latent row `[lat (R) | k_rope]` (576 values at full size) and, with an indexer,
the index key. `kv_b_proj` is kept split as `k_up_proj` `[R, H, nope]` and `v_up_proj` `[R, H, v]` (split once
at conversion), which serves both forms:
- naive:    expand cached latents to per-head keys/values, then ordinary attention;
- absorbed: fold k_up into the query (576-d MQA over the cache) and v_up into the output.
Both read the same cache and give the same result; decode uses the absorbed form.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.indexer import reference as index_ops
from pallas_kernels.mla import reference as mla_ops

from ..config import IndexerConfig, MLAConfig
from .layers import LayerNorm, Linear, RMSNorm, normal_init
from .rope import apply_rope, rope_cos_sin


class MLACache(NamedTuple):
    kv_bsc: jax.Array  # [B, S_max, R + rope] latent rows
    index_k_bsd: jax.Array  # [B, S_max, index_dim] (width 0 without an indexer)

    @staticmethod
    def zeros(batch: int, max_len: int, mla: MLAConfig, indexer: Optional[IndexerConfig], dtype) -> "MLACache":
        c = mla.kv_lora_rank + mla.qk_rope_head_dim
        di = indexer.head_dim if indexer is not None else 0
        return MLACache(jnp.zeros((batch, max_len, c), dtype), jnp.zeros((batch, max_len, di), dtype))


def _write_rows(buf_bsc, rows_btc, starts_b):
    """Write each sequence's new rows at its own offset: buf[b, starts[b] + t] = rows[b, t]."""
    write = lambda buf, rows, s: jax.lax.dynamic_update_slice(buf, rows.astype(buf.dtype), (s, 0))
    return jax.vmap(write)(buf_bsc, rows_btc, starts_b)


class Indexer(nnx.Module):
    """DSA lightning indexer: per query, the top-k earlier tokens every head may attend to."""

    def __init__(self, hidden: int, q_rank: int, cfg: IndexerConfig, rope, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.cfg = cfg
        self.rope = rope
        self.wq_b = Linear(q_rank, cfg.num_heads * cfg.head_dim, rngs=rngs, dtype=dtype)
        self.wk = Linear(hidden, cfg.head_dim, rngs=rngs, dtype=dtype)
        self.k_norm = LayerNorm(cfg.head_dim, cfg.norm_eps, rngs=rngs, dtype=dtype)
        self.weights_proj = Linear(hidden, cfg.num_heads, rngs=rngs, dtype=dtype)

    def keys(self, x_btd, cos_sin):
        k = self.k_norm(self.wk(x_btd))
        if self.cfg.rope_dims and cos_sin is not None:
            r = self.cfg.rope_dims
            k = jnp.concatenate([apply_rope(k[..., :r], *cos_sin, interleaved=False), k[..., r:]], axis=-1)
        return k

    def keep_mask(self, x_btd, cq_btr, keys_bsd, allowed_bts, cos_sin):
        """Boolean `[B, T, S]`: allowed keys among each query's top-k index scores."""
        cfg = self.cfg
        B, T, _ = x_btd.shape
        q = self.wq_b(cq_btr).reshape(B, T, cfg.num_heads, cfg.head_dim)
        if cfg.rope_dims and cos_sin is not None:
            r = cfg.rope_dims
            q = jnp.concatenate([apply_rope(q[..., :r], *cos_sin, interleaved=False), q[..., r:]], axis=-1)
        w = self.weights_proj(x_btd, out_dtype=jnp.float32) * (cfg.num_heads ** -0.5 * cfg.head_dim ** -0.5)
        s = index_ops.scores(q, keys_bsd, w, allowed_bts)
        return index_ops.topk_mask(s, allowed_bts, cfg.topk)


class MultiHeadLatentAttention(nnx.Module):
    def __init__(self, hidden: int, cfg: MLAConfig, indexer: Optional[IndexerConfig], *, rngs: nnx.Rngs,
                 dtype=jnp.float32):
        self.cfg = cfg
        H, R = cfg.num_heads, cfg.kv_lora_rank
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(hidden, H * cfg.qk_head_dim, rngs=rngs, dtype=dtype)
        else:
            self.q_a_proj = Linear(hidden, cfg.q_lora_rank, rngs=rngs, dtype=dtype)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.q_norm_eps, rngs=rngs, dtype=dtype)
            self.q_b_proj = Linear(cfg.q_lora_rank, H * cfg.qk_head_dim, rngs=rngs, dtype=dtype)
        self.kv_a_proj_with_mqa = Linear(hidden, R + cfg.qk_rope_head_dim, rngs=rngs, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(R, cfg.kv_norm_eps, rngs=rngs, dtype=dtype)
        self.k_up_proj = nnx.Param(normal_init(rngs, (R, H, cfg.qk_nope_head_dim), R ** -0.5, dtype))
        self.v_up_proj = nnx.Param(normal_init(rngs, (R, H, cfg.v_head_dim), R ** -0.5, dtype))
        if cfg.output_gate:
            self.g_proj = Linear(hidden, H * cfg.v_head_dim, rngs=rngs, dtype=dtype)
        self.o_proj = Linear(H * cfg.v_head_dim, hidden, rngs=rngs, dtype=dtype)
        if indexer is not None:
            if cfg.q_lora_rank is None:
                raise ValueError("the DSA indexer reads the q LoRA latent; this MLA has no q_lora_rank")
            self.indexer = Indexer(hidden, cfg.q_lora_rank, indexer, cfg.rope, rngs=rngs, dtype=dtype)
        else:
            self.indexer = None

    def __call__(self, x_btd, cache: Optional[MLACache], start, *, form: str = "absorbed"):
        """x `[B, T, D]` (after input_layernorm) at positions start…start+T−1 (`start`: scalar or `[B]`).

        `cache` buffers are written at `start` and attended up to start+T; without a cache the new rows alone are
        the keys. Returns (out `[B, T, D]`, new cache or None).
        """
        cfg = self.cfg
        B, T, _ = x_btd.shape
        H, R, nope, rope_d = cfg.num_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        if cfg.q_lora_rank is None:
            cq = None
            q = self.q_proj(x_btd)
        else:
            cq = self.q_a_layernorm(self.q_a_proj(x_btd))
            q = self.q_b_proj(cq)
        q = q.reshape(B, T, H, cfg.qk_head_dim)
        q_nope, q_rope = q[..., :nope], q[..., nope:]
        ckv = self.kv_a_proj_with_mqa(x_btd)
        lat, k_rope = self.kv_a_layernorm(ckv[..., :R]), ckv[..., R:]
        positions = jnp.broadcast_to(start, (B,))[:, None] + jnp.arange(T)[None, :]  # [B, T]
        cos_sin = None
        if cfg.rope is not None:
            cos_sin = rope_cos_sin(positions, rope_d, cfg.rope)
            q_rope = apply_rope(q_rope, *cos_sin, interleaved=cfg.rope.interleaved)
            k_rope = apply_rope(k_rope, *cos_sin, interleaved=cfg.rope.interleaved)
        row = jnp.concatenate([lat, k_rope], axis=-1)
        index_k = self.indexer.keys(x_btd, cos_sin) if self.indexer is not None else None

        if cache is None:
            kv_bsc, keys = row, index_k
            new_cache = None
        else:
            starts_b = jnp.broadcast_to(start, (B,))
            kv_bsc = _write_rows(cache.kv_bsc, row, starts_b)
            keys = cache.index_k_bsd
            if index_k is not None:
                keys = _write_rows(keys, index_k, starts_b)
            new_cache = MLACache(kv_bsc, keys)
        S = kv_bsc.shape[1]
        allowed = jnp.arange(S)[None, None, :] <= positions[:, :, None]  # causal, and nothing past the cache end
        mask = allowed
        if self.indexer is not None:
            mask = self.indexer.keep_mask(x_btd, cq, keys, allowed, cos_sin)

        if form == "absorbed":
            q_lat = jnp.einsum("bthn,rhn->bthr", q_nope.astype(jnp.float32), self.k_up_proj[...].astype(jnp.float32))
            q_full = jnp.concatenate([q_lat, q_rope.astype(jnp.float32)], axis=-1)
            o_lat, _ = mla_ops.absorbed(q_full, kv_bsc, mask, cfg.softmax_scale, R)
            o = jnp.einsum("bthr,rhv->bthv", o_lat, self.v_up_proj[...].astype(jnp.float32))
        elif form == "naive":
            lat_s = kv_bsc[..., :R].astype(jnp.float32)
            k_nope = jnp.einsum("bsr,rhn->bshn", lat_s, self.k_up_proj[...].astype(jnp.float32))
            v = jnp.einsum("bsr,rhv->bshv", lat_s, self.v_up_proj[...].astype(jnp.float32))
            k_r = jnp.broadcast_to(kv_bsc[:, :, None, R:].astype(jnp.float32), (B, S, H, rope_d))
            k = jnp.concatenate([k_nope, k_r], axis=-1)
            qf = jnp.concatenate([q_nope, q_rope], axis=-1).astype(jnp.float32)
            o = mla_ops.attention(qf, k, v, mask, cfg.softmax_scale)
        else:
            raise ValueError(f"unknown MLA form {form!r}")
        o = o.reshape(B, T, H * cfg.v_head_dim)
        if cfg.output_gate:
            o = o * jax.nn.sigmoid(self.g_proj(x_btd, out_dtype=jnp.float32))
        return self.o_proj(o.astype(x_btd.dtype)), new_cache
