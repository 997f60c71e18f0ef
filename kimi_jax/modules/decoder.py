"""The decoder stack: embeddings, decoder layers (KDA or MLA + dense FFN or MoE), AttnRes residuals, final mix,
norm and lm_head. One definition serves full forwards, prefill and decode (docs/model.md §3)."""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
from flax import nnx

from ..cache import PAGE_TOKENS
from sharding.context import ForwardContext

from ..config import ModelConfig
from ..paged_cache import NULL_BLOCK, LayerPool, PagedCacheSpec
from .attn_res import AttnResMix
from .kda import KDACache, KDAPending, KimiDeltaAttention, commit as kda_commit
from .layers import Linear, RMSNorm, activation_fn, normal_init
from .mla import MLACache, MultiHeadLatentAttention, PagedMLACache
from .moe import MoE, DenseMLP

LayerCache = Union[KDACache, MLACache]


class ModelCache(NamedTuple):
    """Inference state of a batch: `length` `[B]` int32, the tokens each sequence has cached, and one entry per
    layer. Sequences advance independently (continuous batching): each writes and attends at its own length."""

    length: jax.Array
    layers: tuple

    @staticmethod
    def zeros(cfg: ModelConfig, batch: int, max_len: int, dtype) -> "ModelCache":
        layers = tuple(
            KDACache.zeros(batch, cfg.kda, dtype) if kind == "kda"
            else MLACache.zeros(batch, max_len, cfg.mla, cfg.indexer, dtype)
            for kind in cfg.layer_kinds)
        return ModelCache(jnp.zeros((batch,), jnp.int32), layers)

    def insert(self, slot, one: "ModelCache") -> "ModelCache":
        """Copy a batch-1 cache (e.g. a fresh prefill) into row `slot` of this batch cache."""
        put = lambda dst, src: jax.lax.dynamic_update_index_in_dim(dst, src[0].astype(dst.dtype), slot, 0)
        return jax.tree.map(put, self, one)

    def take(self, slot) -> "ModelCache":
        """Row `slot` as a batch-1 cache."""
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, slot, 0, keepdims=True), self)

    @property
    def max_len(self) -> int:
        for c in self.layers:
            if isinstance(c, MLACache):
                return c.kv_bsc.shape[1]
        return 1 << 62


@partial(jax.tree_util.register_dataclass, data_fields=["length", "block_tables", "layers"], meta_fields=["spec"])
@dataclasses.dataclass(frozen=True)
class PagedModelCache:
    """Inference state of a batch on the paged MLA cache (docs/model.md §10).

    length `[B]` int32: tokens each sequence has cached; block_tables `[B, max_blocks]` int32: the pages of each
    sequence in order (position p in page `block_tables[b, p // 64]`, slot `p % 64`; unused entries = null block
    0); layers: per layer a `KDACache` with B rows (KDA state stays per sequence) or the MLA layer's `LayerPool`
    (pages shared by the whole batch, the same block ids in every MLA layer); spec: the static `PagedCacheSpec`
    (formats, pool size). All shapes are fixed by (B, max_blocks, spec), so programs over it never recompile as
    sequences grow: the host (`paged_cache.BlockAllocator`) hands out pages and passes new tables in.

    Writes to positions whose page is not in the table (or is the null block) are dropped.
    """

    length: jax.Array
    block_tables: jax.Array
    layers: tuple
    spec: PagedCacheSpec

    @staticmethod
    def zeros(cfg: ModelConfig, spec: PagedCacheSpec, batch: int, max_blocks: int, dtype,
              latent_scales=None, ranks: int = 1) -> "PagedModelCache":
        """Empty cache: all lengths 0, all tables null, zeroed KDA states and pools (one pool per MLA layer, in
        layer order, with its latent scale; `ranks` > 1: the pools of that many DCP ranks stacked on dim 0)."""
        if spec.config.mla != cfg.mla or spec.config.indexer != cfg.indexer:
            raise ValueError("the PagedCacheSpec was built for a different MLA / indexer configuration")
        pools = iter(spec.init(latent_scales, ranks))
        layers = tuple(KDACache.zeros(batch, cfg.kda, dtype) if kind == "kda" else next(pools)
                       for kind in cfg.layer_kinds)
        return PagedModelCache(jnp.zeros((batch,), jnp.int32), jnp.full((batch, max_blocks), NULL_BLOCK, jnp.int32),
                               layers, spec)

    def replace(self, **changes) -> "PagedModelCache":
        return dataclasses.replace(self, **changes)

    def with_block_tables(self, block_tables) -> "PagedModelCache":
        """The same cache under new tables `[B, max_blocks]` (e.g. after the allocator grew some sequences)."""
        bt = jnp.asarray(block_tables, jnp.int32)
        if bt.shape != self.block_tables.shape:
            raise ValueError(f"block tables must be {self.block_tables.shape}, got {bt.shape}")
        return self.replace(block_tables=bt)

    @property
    def max_len(self) -> int:
        """Tokens a sequence can hold: max_blocks pages."""
        return self.block_tables.shape[1] * PAGE_TOKENS

    @property
    def batch(self) -> int:
        return self.length.shape[0]

    def take(self, slot) -> "PagedModelCache":
        """Row `slot` as a batch-1 cache; the pools are shared (not copied)."""
        row = lambda a: jax.lax.dynamic_index_in_dim(a, slot, 0, keepdims=True)
        layers = tuple(c if isinstance(c, LayerPool) else jax.tree.map(row, c) for c in self.layers)
        return self.replace(length=row(self.length), block_tables=row(self.block_tables), layers=layers)

    def insert(self, slot, one: "PagedModelCache") -> "PagedModelCache":
        """Put batch-1 cache `one` (e.g. a fresh prefill of `take(slot)`) into row `slot`: its KDA rows, length and
        block table; the pools are taken from `one` (they already hold its rows)."""
        put = lambda dst, src: jax.lax.dynamic_update_index_in_dim(dst, src[0].astype(dst.dtype), slot, 0)
        layers = tuple(o if isinstance(o, LayerPool) else jax.tree.map(put, c, o)
                       for c, o in zip(self.layers, one.layers))
        return self.replace(length=put(self.length, one.length), block_tables=put(self.block_tables, one.block_tables),
                            layers=layers)

    def layer_view(self, i: int):
        """What layer i is called with: its `KDACache`, or a `PagedMLACache` (pool + this batch's tables)."""
        c = self.layers[i]
        return PagedMLACache(c, self.block_tables, self.spec) if isinstance(c, LayerPool) else c


AnyCache = Union[ModelCache, PagedModelCache]


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs, dtype=jnp.float32):
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.kind = cfg.layer_kinds[layer]
        self.input_layernorm = RMSNorm(D, eps, rngs=rngs, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(D, eps, rngs=rngs, dtype=dtype)
        if self.kind == "kda":
            self.self_attn = KimiDeltaAttention(D, cfg.kda, rngs=rngs, dtype=dtype)
        else:
            self.self_attn = MultiHeadLatentAttention(D, cfg.mla, cfg.indexer, rngs=rngs, dtype=dtype)
        act = activation_fn(cfg)
        if cfg.is_moe_layer(layer):
            self.block_sparse_moe = MoE(D, cfg.moe, act, eps, rngs=rngs, dtype=dtype)
            self.mlp = None
        else:
            self.mlp = DenseMLP(D, cfg.dense_intermediate_size, act, rngs=rngs, dtype=dtype)
            self.block_sparse_moe = None
        if cfg.attn_res_block_size:
            self.self_attention_res = AttnResMix(D, eps, rngs=rngs, dtype=dtype)
            self.mlp_res = AttnResMix(D, eps, rngs=rngs, dtype=dtype)

    def attn(self, h, cache, start, ctx: ForwardContext, mla_form: str = "absorbed", defer_kda: bool = False):
        x = self.input_layernorm(h, ctx)
        if self.kind == "kda":
            return self.self_attn(x, cache, ctx=ctx, defer=defer_kda)
        return self.self_attn(x, cache, start, ctx=ctx, form=mla_form)

    def ffn(self, h, ctx: ForwardContext):
        x = self.post_attention_layernorm(h, ctx)
        return self.mlp(x) if self.mlp is not None else self.block_sparse_moe(x, ctx)


class KimiForCausalLM(nnx.Module):
    """The whole text model. `__call__(ids, cache, start)` -> (logits float32 `[B, T, V]`, new cache)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.cfg = cfg
        D = cfg.hidden_size
        self.embed_tokens = nnx.Param(normal_init(rngs, (cfg.vocab_size, D), 1.0, dtype))
        self.layers = nnx.List([DecoderLayer(cfg, i, rngs=rngs, dtype=dtype)
                                for i in range(cfg.num_layers)])
        self.norm = RMSNorm(D, cfg.rms_norm_eps, rngs=rngs, dtype=dtype)
        if cfg.attn_res_block_size:
            self.output_attn_res = AttnResMix(D, cfg.rms_norm_eps, rngs=rngs, dtype=dtype)
        self.lm_head = None if cfg.tie_embeddings else Linear(D, cfg.vocab_size, rngs=rngs, dtype=dtype)

    def hidden_states(self, ids_bt, cache: Optional[AnyCache] = None, *, ctx: ForwardContext = ForwardContext(),
                      mla_form: str = "absorbed", mm=None, defer_kda: bool = False):
        """Final normed hidden states `[B, T, D]` and the new cache (None without one). The one forward driver:
        `Model`, the engine's programs and the context-parallel programs all run it, with their `ctx`.

        `cache`: a contiguous `ModelCache` or a `PagedModelCache` (MLA layers then run on the paged pools; the
        caller's block tables must already cover positions length…length+T−1 of every sequence written).
        `mm`: None, or (features `[B, T, D]`, mask bool `[B, T]`): where the mask is set the input embedding is the
        feature row instead of the token's (image tokens: the vision tower's output at each `<|media_pad|>`).
        `defer_kda`: speculative verification — the new cache's KDA layers are `KDAPending` (nothing committed) and
        its length counts all T tokens; `commit_verify` then keeps each sequence's accepted prefix."""
        cfg = self.cfg
        start = cache.length if cache is not None else jnp.zeros((), jnp.int32)
        h0 = jnp.take(self.embed_tokens[...], ids_bt, axis=0)
        if mm is not None:
            feats_btD, mask_bt = mm
            h0 = jnp.where(mask_bt[..., None], feats_btD.astype(h0.dtype), h0)
        new_layers = []
        block = cfg.attn_res_block_size
        prefix, blocks = h0, []
        paged = isinstance(cache, PagedModelCache)
        for i, layer in enumerate(self.layers):
            if cache is None:
                layer_cache = None
            else:
                layer_cache = cache.layer_view(i) if paged else cache.layers[i]
            if block:
                h = prefix if not blocks else layer.self_attention_res(blocks + [prefix])
                if i % block == 0:
                    blocks.append(prefix)
                    prefix = None
                a, c = layer.attn(h, layer_cache, start, ctx, mla_form, defer_kda)
                prefix = a if prefix is None else prefix + a
                h = layer.mlp_res(blocks + [prefix])
                prefix = prefix + layer.ffn(h, ctx)
            else:  # plain pre-norm residual stream
                a, c = layer.attn(prefix, layer_cache, start, ctx, mla_form, defer_kda)
                prefix = prefix + a
                prefix = prefix + layer.ffn(prefix, ctx)
            new_layers.append(c.pool if isinstance(c, PagedMLACache) else c)
        h = self.output_attn_res(blocks + [prefix]) if block else prefix
        h = self.norm(h, ctx)
        new_cache = None
        # tokens the cache gains: this device's ids, or under the token split the whole prompt / chunk's real tokens
        grown = None if cache is None else cache.length + (ctx.valid_len if ctx.token_split else ids_bt.shape[1])
        if paged:
            new_cache = cache.replace(length=grown, layers=tuple(new_layers))
        elif cache is not None:
            new_cache = ModelCache(grown, tuple(new_layers))
        return h, new_cache

    def commit_verify(self, cache: AnyCache, old_length, keep_b, ctx: ForwardContext = ForwardContext()) -> AnyCache:
        """After a `defer_kda` pass over T tokens from `old_length` `[B]`: the cache holding only the first
        `keep_b[b]` (0 ≤ keep ≤ T) of them. KDA layers replay their recurrence over the kept tokens
        (`modules.kda.commit`); MLA rows past the new length stay where they were written and are overwritten
        before anything reads them (every step writes its positions before attending)."""
        keep_b = jnp.asarray(keep_b, jnp.int32)
        layers = tuple(kda_commit(c, keep_b, ctx) if isinstance(c, KDAPending) else c for c in cache.layers)
        length = jnp.asarray(old_length, jnp.int32) + keep_b
        if isinstance(cache, PagedModelCache):
            return cache.replace(length=length, layers=layers)
        return ModelCache(length, layers)

    def logits(self, h_btd):
        """float32 logits `[B, T, V]` of final hidden states `[B, T, D]` (tied embeddings or lm_head)."""
        if self.lm_head is None:
            return jnp.dot(h_btd, self.embed_tokens[...].T, preferred_element_type=jnp.float32)
        return self.lm_head(h_btd, out_dtype=jnp.float32)

    def __call__(self, ids_bt, cache: Optional[AnyCache] = None, *, ctx: ForwardContext = ForwardContext(),
                 mla_form: str = "absorbed", mm=None, defer_kda: bool = False):
        h, new_cache = self.hidden_states(ids_bt, cache, ctx=ctx, mla_form=mla_form, mm=mm, defer_kda=defer_kda)
        return self.logits(h), new_cache
