"""Gated NoPE MLA (K3) and RoPE MLA (DeepSeek), with the DSA lightning indexer (docs/model.md §5–6).

The cache holds, per token, the latent row `[lat (R) | k_rope]` (576 values at full size) and, with an indexer,
the index key. `kv_b_proj` is kept split as `k_up_proj` `[R, H, nope]` and `v_up_proj` `[R, H, v]` (split once
at conversion), which serves both forms:
- naive:    expand cached latents to per-head keys/values, then ordinary attention;
- absorbed: fold k_up into the query (576-d MQA over the cache) and v_up into the output.
Both read the same cache and give the same result; decode uses the absorbed form.

Two cache types, one module:
- `MLACache` — contiguous `[B, S_max, ·]` rows per sequence; the indexer's top-k becomes a dense keep-mask
  (the reference path; both forms).
- `PagedMLACache` — one layer's `kimi_jax.paged_cache.LayerPool` (pages of 64 tokens shared by all sequences, stored
  bf16 / fp8 / nvfp4, index keys bf16 / fp8 / mxfp4) plus the batch's block tables. New rows are quantised on write
  at each sequence's own start (padding rows dropped), then the indexer picks top-k positions over the paged keys
  (`pallas_kernels.indexer.paged`) and sparse absorbed MLA attends to exactly those rows
  (`pallas_kernels.mla.sparse`). Without an indexer (Kimi-Linear, K3) the "selection" is every position ≤ the
  query's. Absorbed form only (the naive form would expand every cached row).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.indexer import reference as index_ops
from pallas_kernels.mla import reference as mla_ops
from sharding import context_parallel as cp
from sharding import dsa
from sharding.context import ForwardContext

from ..cache import PAGE_TOKENS
from ..config import IndexerConfig, MLAConfig
from ..paged_cache import LayerPool, PagedCacheSpec
from ..quant import hadamard
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


@partial(jax.tree_util.register_dataclass, data_fields=["pool", "block_tables"], meta_fields=["spec"])
@dataclass(frozen=True)
class PagedMLACache:
    """One MLA layer's view of a paged cache during a forward call (`PagedModelCache` builds it per layer).

    pool: the layer's `LayerPool` (parts `[num_blocks, 64, w]`, shared by every sequence); block_tables `[B,
    max_blocks]` int32 (position p of row b lives in page `block_tables[b, p // 64]`; unused entries = null block
    0); spec: the static `PagedCacheSpec` (storage formats). Pages for the positions written must be in the table.
    """

    pool: LayerPool
    block_tables: jax.Array
    spec: PagedCacheSpec

    @property
    def max_len(self) -> int:
        return self.block_tables.shape[1] * PAGE_TOKENS


class Projected(NamedTuple):
    """Everything a forward derives from x before touching a cache (`MultiHeadLatentAttention.project`)."""

    q_nope: jax.Array  # [B, T, H, nope]
    q_rope: jax.Array  # [B, T, H, rope] (rotated for DeepSeek)
    row: jax.Array  # [B, T, R + rope] new latent rows [lat | k_rope]
    index_k: Optional[jax.Array]  # [B, T, d_index] new index keys (None without an indexer)
    cq: Optional[jax.Array]  # [B, T, q_lora_rank] the q latent (indexer queries read it)
    cos_sin: Optional[tuple]
    positions: jax.Array  # [B, T] int32 sequence positions of the new tokens


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
        return hadamard(k) if self.cfg.hadamard_rotate else k

    def queries(self, x_btd, cq_btr, cos_sin):
        """Index queries `[B, T, Hi, d]` and head weights float32 `[B, T, Hi]` (Hi^-0.5 · d^-0.5 folded in)."""
        cfg = self.cfg
        B, T, _ = x_btd.shape
        q = self.wq_b(cq_btr).reshape(B, T, cfg.num_heads, cfg.head_dim)
        if cfg.rope_dims and cos_sin is not None:
            r = cfg.rope_dims
            q = jnp.concatenate([apply_rope(q[..., :r], *cos_sin, interleaved=False), q[..., r:]], axis=-1)
        if cfg.hadamard_rotate:  # docs/model.md §6: rotate both q and k or neither (keys in `keys`)
            q = hadamard(q)
        w = self.weights_proj(x_btd, out_dtype=jnp.float32) * (cfg.num_heads ** -0.5 * cfg.head_dim ** -0.5)
        return q, w

    def keep_mask(self, x_btd, cq_btr, keys_bsd, allowed_bts, cos_sin):
        """Boolean `[B, T, S]`: allowed keys among each query's top-k index scores (contiguous keys)."""
        q, w = self.queries(x_btd, cq_btr, cos_sin)
        s = index_ops.scores(q, keys_bsd, w, allowed_bts)
        return index_ops.topk_mask(s, allowed_bts, self.cfg.topk)

    def topk_paged(self, ctx: ForwardContext, x_btd, cq_btr, cache: PagedMLACache, query_pos_bt, cos_sin):
        """Top-k positions int32 `[B, T, topk]` (−1 = empty) over the paged index keys; query_pos −1 = padding."""
        q, w = self.queries(x_btd, cq_btr, cos_sin)
        return dsa.topk_indices(ctx, q, w, cache.pool.index, cache.block_tables, query_pos_bt, self.cfg.topk,
                                fmt=cache.spec.index_format)


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

    def __call__(self, x_btd, cache: Union[None, MLACache, PagedMLACache], start, *,
                 ctx: ForwardContext = ForwardContext(), form: str = "absorbed", lengths=None):
        """x `[B, T, D]` (after input_layernorm) at positions start…start+T−1 (`start`: scalar or `[B]`).

        `cache` buffers are written at `start` and attended up to start+T; without a cache the new rows alone are
        the keys. `lengths` `[B]` (paged cache only): how many of the T tokens are real; rows past it are padding
        (not written, select nothing, output 0). Returns (out `[B, T, D]`, new cache or None).
        """
        p = self.project(x_btd, start, ctx)
        if isinstance(cache, PagedMLACache):  # the engine's programs (plain, or its token-split prefill chunks)
            if form != "absorbed":
                raise ValueError(f"the paged MLA cache runs the absorbed form only, got form={form!r}")
            o_lat, new_cache = self.attend_paged(ctx, x_btd, p, cache, lengths)
            return self.output(x_btd, self.up_values(o_lat)), new_cache
        if ctx.splits_mla:  # the context-parallel programs: token / head split prefill, DCP / TP decode
            o_bthv, new_cache = self.attend_context_parallel(ctx, x_btd, p, cache)
            return self.output(x_btd, o_bthv), new_cache
        if lengths is not None:
            raise ValueError("lengths (padding rows) is supported with the paged cache only")
        if cache is None:
            kv_bsc, keys = p.row, p.index_k
            new_cache = None
        else:
            starts_b = p.positions[:, 0]
            kv_bsc = _write_rows(cache.kv_bsc, p.row, starts_b)
            keys = cache.index_k_bsd
            if p.index_k is not None:
                keys = _write_rows(keys, p.index_k, starts_b)
            new_cache = MLACache(kv_bsc, keys)
        return self.output(x_btd, self.attend_contiguous(x_btd, p, kv_bsc, keys, form)), new_cache

    def project(self, x_btd, start, ctx: ForwardContext = ForwardContext()) -> Projected:
        """Queries, the new latent rows and index keys of x `[B, T, D]` at positions start…start+T−1 — under the
        token split (this device holding a contiguous slice of the prompt or chunk) from start + the slice's offset
        (`ForwardContext.first_token`)."""
        cfg = self.cfg
        B, T, _ = x_btd.shape
        H, R, nope, rope_d = cfg.num_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        if cfg.q_lora_rank is None:
            cq = None
            q = self.q_proj(x_btd)
        else:
            cq = self.q_a_layernorm(self.q_a_proj(x_btd), ctx)
            q = self.q_b_proj(cq)
        q = q.reshape(B, T, H, cfg.qk_head_dim)
        q_nope, q_rope = q[..., :nope], q[..., nope:]
        ckv = self.kv_a_proj_with_mqa(x_btd)
        lat, k_rope = self.kv_a_layernorm(ckv[..., :R], ctx), ckv[..., R:]
        first = jnp.asarray(start, jnp.int32) + ctx.first_token(T)
        positions = jnp.broadcast_to(first, (B,))[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]  # [B, T]
        cos_sin = None
        if cfg.rope is not None:
            cos_sin = rope_cos_sin(positions, rope_d, cfg.rope)
            q_rope = apply_rope(q_rope, *cos_sin, interleaved=cfg.rope.interleaved)
            k_rope = apply_rope(k_rope, *cos_sin, interleaved=cfg.rope.interleaved)
        row = jnp.concatenate([lat, k_rope], axis=-1)
        index_k = self.indexer.keys(x_btd, cos_sin) if self.indexer is not None else None
        return Projected(q_nope, q_rope, row, index_k, cq, cos_sin, positions)

    def absorbed_query(self, p: Projected):
        """float32 `[B, T, H, R + rope]`: `[q_nope · W_UK | q_rope]`, the MQA query over latent rows."""
        q_lat = jnp.einsum("bthn,rhn->bthr", p.q_nope.astype(jnp.float32), self.k_up_proj[...].astype(jnp.float32))
        return jnp.concatenate([q_lat, p.q_rope.astype(jnp.float32)], axis=-1)

    def up_values(self, o_lat_bthr):
        """Latent attention output `[B, T, H, R]` -> per-head values float32 `[B, T, H, v]` (W_UV folded in)."""
        return jnp.einsum("bthr,rhv->bthv", o_lat_bthr, self.v_up_proj[...].astype(jnp.float32))

    def attend_contiguous(self, x_btd, p: Projected, kv_bsc, keys_bsd, form: str = "absorbed"):
        """Attention over contiguous rows `kv_bsc` `[B, S, R+rope]` (and index keys `[B, S, d]`) -> `[B, T, H, v]`."""
        cfg = self.cfg
        B, T, _ = x_btd.shape
        H, R, rope_d = cfg.num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        S = kv_bsc.shape[1]
        allowed = jnp.arange(S)[None, None, :] <= p.positions[:, :, None]  # causal, and nothing past the cache end
        mask = allowed
        if self.indexer is not None:
            mask = self.indexer.keep_mask(x_btd, p.cq, keys_bsd, allowed, p.cos_sin)

        if form == "absorbed":
            o_lat, _ = mla_ops.absorbed(self.absorbed_query(p), kv_bsc, mask, cfg.softmax_scale, R)
            return self.up_values(o_lat)
        if form == "naive":
            lat_s = kv_bsc[..., :R].astype(jnp.float32)
            k_nope = jnp.einsum("bsr,rhn->bshn", lat_s, self.k_up_proj[...].astype(jnp.float32))
            v = jnp.einsum("bsr,rhv->bshv", lat_s, self.v_up_proj[...].astype(jnp.float32))
            k_r = jnp.broadcast_to(kv_bsc[:, :, None, R:].astype(jnp.float32), (B, S, H, rope_d))
            k = jnp.concatenate([k_nope, k_r], axis=-1)
            qf = jnp.concatenate([p.q_nope, p.q_rope], axis=-1).astype(jnp.float32)
            return mla_ops.attention(qf, k, v, mask, cfg.softmax_scale)
        raise ValueError(f"unknown MLA form {form!r}")

    def attend_paged(self, ctx: ForwardContext, x_btd, p: Projected, cache: PagedMLACache, lengths=None):
        """Write the new rows into the pool (quantise-on-write), select, attend sparsely.

        Returns (o_lat float32 `[B, T, H, R]`, the cache with the updated pool). Padding rows (t ≥ lengths[b])
        are not written and select nothing (o_lat = 0 there).

        Under the engine's token-split prefill (`ctx.token_split`, over the DCP axis: this device holds T = C / N
        consecutive tokens of a C-token chunk) the chunk's rows, index keys, positions and queries are gathered
        over the axis first: each rank stores the rows of the whole chunk that it owns and attends all C queries
        over its own keys (the earlier chunks' and this one's), and the log-sum-exp merge leaves each device its
        own T tokens' outputs. The queries travel as q_nope / q_rope (in the model's dtype) and are absorbed after
        the gather.
        """
        cfg = self.cfg
        spec = cache.spec
        index_queries = None  # (qi, w) of the DCP top-k
        if ctx.token_split:
            if ctx.dcp < 2 or ctx.dcp_axis != ctx.axes.context or lengths is not None:
                raise ValueError("a token-split prefill into the paged cache runs over the DCP axis (dcp > 1), "
                                 "on real tokens only")
            chunk = lambda a: jax.lax.all_gather(a, ctx.axes.context, axis=1, tiled=True)
            # the indexer queries from this device's x and q latent, then gathered
            index_queries = None if self.indexer is None else tuple(
                chunk(a) for a in self.indexer.queries(x_btd, p.cq, p.cos_sin))
            p = p._replace(q_nope=chunk(p.q_nope), q_rope=chunk(p.q_rope), row=chunk(p.row),
                           index_k=None if p.index_k is None else chunk(p.index_k), positions=chunk(p.positions),
                           cq=None, cos_sin=None)  # (those two served this device's tokens above)
        elif ctx.dcp > 1 and self.indexer is not None:
            index_queries = self.indexer.queries(x_btd, p.cq, p.cos_sin)
        B, T = p.positions.shape
        starts_b = p.positions[:, 0]
        if ctx.dcp > 1:  # the pages split over the DCP axis token by token: each rank stores the tokens it owns
            pool = dsa.dcp_write(ctx, spec, cache.pool, cache.block_tables, starts_b, p.row, p.index_k, lengths)
        else:
            pool = spec.write(cache.pool, cache.block_tables, starts_b, p.row, p.index_k, lengths)
        cache = PagedMLACache(pool, cache.block_tables, spec)
        qpos_bt = p.positions
        if lengths is not None:
            real = jnp.arange(T, dtype=jnp.int32)[None] < jnp.asarray(lengths, jnp.int32).reshape(B, 1)
            qpos_bt = jnp.where(real, qpos_bt, -1)
        kw = dict(fmt=spec.latent_format, scale=cfg.softmax_scale, value_dim=cfg.kv_lora_rank)
        layer_scale = jnp.asarray(pool.latent_scale, jnp.float32)
        if ctx.dcp > 1:  # each rank attends to its own tokens, merged by log-sum-exp
            if self.indexer is None:
                o_lat, _ = dsa.dcp_dense_attention(ctx, self.absorbed_query(p), pool.latent, cache.block_tables,
                                                   qpos_bt, layer_scale, **kw)
            else:
                qi, w = index_queries
                o_lat, _ = dsa.dcp_sparse_attention(
                    ctx, self.absorbed_query(p), qi, w, pool.latent, pool.index, cache.block_tables, qpos_bt,
                    layer_scale, self.indexer.cfg.topk, latent_fmt=kw["fmt"], index_fmt=spec.index_format,
                    scale=kw["scale"], value_dim=kw["value_dim"])
        elif self.indexer is not None:
            idx_btk = self.indexer.topk_paged(ctx, x_btd, p.cq, cache, qpos_bt, p.cos_sin)
            o_lat, _ = dsa.sparse_attention(ctx, self.absorbed_query(p), pool.latent, cache.block_tables, idx_btk,
                                            layer_scale, **kw)
        else:  # no indexer: every cached position up to the query's own
            o_lat, _ = dsa.dense_attention(ctx, self.absorbed_query(p), pool.latent, cache.block_tables, qpos_bt,
                                           layer_scale, **kw)
        return o_lat, cache

    # -------------------------------------------------------------------------------- context-parallel programs
    def attend_context_parallel(self, ctx: ForwardContext, x_btd, p: Projected, cache: Optional[MLACache]):
        """Attention under the context-parallel programs' modes, on contiguous caches: (per-head values float32
        `[B, T, H, v]` — the latent output already up-projected by W_UV —, new `MLACache` or None).

        * token / head split prefill: the latent rows (and index keys) of the whole prompt are gathered over the
          context axis and each query attends causally at its global position, query-chunked
          (`context_parallel.mla_attend`); W_UV runs per chunk, so the float32 latent output of all tokens never
          exists at once. The cache slots this device owns are filled from the gathered rows.
        * DCP decode: the new row is written on the device owning its position; each device scores its own keys,
          keeps a local top-k, the candidates are merged across devices, and the partial outputs merge by
          log-sum-exp (`context_parallel.dcp_decode_shard`).
        * TP decode: the cache whole on every device, the same sparse top-k algorithm over all keys.
        """
        if self.cfg.rope is not None:
            raise NotImplementedError("context parallelism covers NoPE MLA (the K3 family); RoPE MLA (DeepSeek) "
                                      "would need global positions in the projections")
        if ctx.mode in ("decode_dcp", "decode_tp"):
            return self._decode_context_parallel(ctx, x_btd, p, cache)
        return self._prefill_context_parallel(ctx, x_btd, p, cache)

    def _prefill_context_parallel(self, ctx: ForwardContext, x_btd, p: Projected, cache):
        cfg = self.cfg
        B, Tl, _ = x_btd.shape
        pos_t = ctx.first_token(Tl) + jnp.arange(Tl, dtype=jnp.int32)
        axis = ctx.axes.context
        gather = (lambda a: jax.lax.all_gather(a, axis, axis=1, tiled=True)) if ctx.token_split else (lambda a: a)
        kv_all = gather(p.row)  # [B, T_pad, R + rope]: every device sees every key row
        kw = dict(scale=cfg.softmax_scale, value_dim=cfg.kv_lora_rank, max_chunk_bytes=ctx.max_chunk_bytes)
        ki_all = None
        if self.indexer is not None:
            ki_all = gather(p.index_k)
            qi, w = self.indexer.queries(x_btd, p.cq, p.cos_sin)
            kw.update(qi_bthd=qi, ki_bsd=ki_all, w_bth=w, topk=self.indexer.cfg.topk)
        # the absorbed float32 query is formed per query chunk from the bf16 q_nope / q_rope: for all tokens at once
        # it is T·H·(R + rope)·4 bytes (13.5 GiB at 64K tokens, 96 heads)
        query_fn = lambda qn, qr: self.absorbed_query(p._replace(q_nope=qn, q_rope=qr))
        o_v, _ = cp.mla_attend((p.q_nope, p.q_rope), kv_all, pos_t, query_fn=query_fn, out_fn=self.up_values, **kw)
        if cache is None:
            return o_v, None
        kv = _fill_slots(ctx, cache.kv_bsc, kv_all)
        ki = cache.index_k_bsd if ki_all is None else _fill_slots(ctx, cache.index_k_bsd, ki_all)
        return o_v, MLACache(kv, ki)

    def _decode_context_parallel(self, ctx: ForwardContext, x_btd, p: Projected, cache: MLACache):
        if x_btd.shape[1] != 1:
            raise ValueError(f"{ctx.mode} runs one token per sequence, got {x_btd.shape[1]}")
        cfg = self.cfg
        pos_b = p.positions[:, 0]
        dcp = ctx.mode == "decode_dcp"
        write = (lambda buf, row: _write_owned(ctx, buf, row, pos_b)) if dcp else (
            lambda buf, row: _write_rows(buf, row[:, None], pos_b))
        kv = write(cache.kv_bsc, p.row[:, 0])
        ki, qi, w, topk = cache.index_k_bsd, None, None, None
        if self.indexer is not None:
            ki = write(ki, p.index_k[:, 0])
            qi, w = self.indexer.queries(x_btd, p.cq, p.cos_sin)
            qi, w, topk = qi[:, 0], w[:, 0], self.indexer.cfg.topk
        q = self.absorbed_query(p)[:, 0]
        kw = dict(scale=cfg.softmax_scale, value_dim=cfg.kv_lora_rank, topk=topk)
        if dcp:
            o, _, _ = cp.dcp_decode_shard(q, kv, pos_b + 1, qi, ki, w, axis=ctx.axes.context, layout=ctx.layout, **kw)
        else:
            o, _, _ = cp.head_split_decode_shard(q, kv, pos_b + 1, qi, ki, w, **kw)
        return self.up_values(o[:, None]), MLACache(kv, ki)

    def output(self, x_btd, o_bthv):
        """Per-head values `[B, T, H, v]` -> output gate (K3) -> o_proj -> `[B, T, D]` in x's dtype."""
        cfg = self.cfg
        B, T, _ = x_btd.shape
        o = o_bthv.reshape(B, T, cfg.num_heads * cfg.v_head_dim)
        if cfg.output_gate:
            o = o * jax.nn.sigmoid(self.g_proj(x_btd, out_dtype=jnp.float32))
        return self.o_proj(o.astype(x_btd.dtype))


def _fill_slots(ctx: ForwardContext, buf_blc, rows_btc):
    """This device's contiguous-cache slots `[B, L, ·]` filled from the prompt rows `[B, T_pad, ·]` (positions 0…;
    only the first valid_len are real)."""
    L, T = buf_blc.shape[1], rows_btc.shape[1]
    pos = ctx.slot_positions(L)
    src = jnp.take(rows_btc, jnp.clip(pos, 0, T - 1), axis=1).astype(buf_blc.dtype)
    return jnp.where((pos < ctx.valid_len)[None, :, None], src, buf_blc)


def _write_owned(ctx: ForwardContext, buf_blc, row_bc, pos_b):
    """Write one row per sequence at global position pos_b on the device that owns it (DCP; one slot each)."""
    L = buf_blc.shape[1]
    d = jax.lax.axis_index(ctx.axes.context)
    if ctx.layout == "contiguous":
        owner, slot = pos_b // L, pos_b % L
    else:
        owner, slot = pos_b % ctx.context_size, pos_b // ctx.context_size
    mine = owner == d

    def one(buf, row, s, m):
        s = jnp.clip(s, 0, L - 1)
        old = jax.lax.dynamic_slice_in_dim(buf, s, 1, 0)
        return jax.lax.dynamic_update_slice_in_dim(buf, jnp.where(m, row[None].astype(buf.dtype), old), s, 0)

    return jax.vmap(one)(buf_blc, row_bc, slot, mine)
