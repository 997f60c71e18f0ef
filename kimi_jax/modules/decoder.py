"""The decoder stack: embeddings, decoder layers (KDA or MLA + dense FFN or MoE), AttnRes residuals, final mix,
norm and lm_head. One definition serves full forwards, prefill and decode (SPEC §3)."""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
from flax import nnx

from ..config import ModelConfig
from ..kernels import KernelConfig
from .attn_res import AttnResMix
from .kda import KDACache, KimiDeltaAttention
from .layers import Linear, RMSNorm, activation_fn, normal_init
from .mla import MLACache, MultiHeadLatentAttention
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


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 kernels: KernelConfig = KernelConfig()):
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.kind = cfg.layer_kinds[layer]
        self.input_layernorm = RMSNorm(D, eps, rngs=rngs, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(D, eps, rngs=rngs, dtype=dtype)
        if self.kind == "kda":
            self.self_attn = KimiDeltaAttention(D, cfg.kda, rngs=rngs, dtype=dtype, kernels=kernels)
        else:
            self.self_attn = MultiHeadLatentAttention(D, cfg.mla, cfg.indexer, rngs=rngs, dtype=dtype)
        act = activation_fn(cfg)
        if cfg.is_moe_layer(layer):
            self.block_sparse_moe = MoE(D, cfg.moe, act, eps, rngs=rngs, dtype=dtype, kernels=kernels)
            self.mlp = None
        else:
            self.mlp = DenseMLP(D, cfg.dense_intermediate_size, act, rngs=rngs, dtype=dtype)
            self.block_sparse_moe = None
        if cfg.attn_res_block_size:
            self.self_attention_res = AttnResMix(D, eps, rngs=rngs, dtype=dtype)
            self.mlp_res = AttnResMix(D, eps, rngs=rngs, dtype=dtype)

    def attn(self, h, cache, start, mla_form):
        x = self.input_layernorm(h)
        if self.kind == "kda":
            return self.self_attn(x, cache)
        return self.self_attn(x, cache, start, form=mla_form)

    def ffn(self, h):
        x = self.post_attention_layernorm(h)
        return self.mlp(x) if self.mlp is not None else self.block_sparse_moe(x)


class KimiForCausalLM(nnx.Module):
    """The whole text model. `__call__(ids, cache, start)` -> (logits float32 `[B, T, V]`, new cache)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 kernels: KernelConfig = KernelConfig()):
        self.cfg = cfg
        D = cfg.hidden_size
        self.embed_tokens = nnx.Param(normal_init(rngs, (cfg.vocab_size, D), 1.0, dtype))
        self.layers = nnx.List([DecoderLayer(cfg, i, rngs=rngs, dtype=dtype, kernels=kernels)
                                for i in range(cfg.num_layers)])
        self.norm = RMSNorm(D, cfg.rms_norm_eps, rngs=rngs, dtype=dtype)
        if cfg.attn_res_block_size:
            self.output_attn_res = AttnResMix(D, cfg.rms_norm_eps, rngs=rngs, dtype=dtype)
        self.lm_head = None if cfg.tie_embeddings else Linear(D, cfg.vocab_size, rngs=rngs, dtype=dtype)

    def hidden_states(self, ids_bt, cache: Optional[ModelCache] = None, *, mla_form: str = "absorbed"):
        """Final normed hidden states `[B, T, D]` and the new cache (None without one)."""
        cfg = self.cfg
        start = cache.length if cache is not None else jnp.zeros((), jnp.int32)
        h0 = jnp.take(self.embed_tokens[...], ids_bt, axis=0)
        new_layers = []
        block = cfg.attn_res_block_size
        prefix, blocks = h0, []
        for i, layer in enumerate(self.layers):
            layer_cache = cache.layers[i] if cache is not None else None
            if block:
                h = prefix if not blocks else layer.self_attention_res(blocks + [prefix])
                if i % block == 0:
                    blocks.append(prefix)
                    prefix = None
                a, c = layer.attn(h, layer_cache, start, mla_form)
                prefix = a if prefix is None else prefix + a
                h = layer.mlp_res(blocks + [prefix])
                prefix = prefix + layer.ffn(h)
            else:  # plain pre-norm residual stream
                a, c = layer.attn(prefix, layer_cache, start, mla_form)
                prefix = prefix + a
                prefix = prefix + layer.ffn(prefix)
            new_layers.append(c)
        h = self.output_attn_res(blocks + [prefix]) if block else prefix
        h = self.norm(h)
        new_cache = None
        if cache is not None:
            new_cache = ModelCache(cache.length + ids_bt.shape[1], tuple(new_layers))
        return h, new_cache

    def __call__(self, ids_bt, cache: Optional[ModelCache] = None, *, mla_form: str = "absorbed"):
        h, new_cache = self.hidden_states(ids_bt, cache, mla_form=mla_form)
        if self.lm_head is None:
            logits = jnp.dot(h, self.embed_tokens[...].T, preferred_element_type=jnp.float32)
        else:
            logits = self.lm_head(h, out_dtype=jnp.float32)
        return logits, new_cache
