"""Name map of DeepSeek-V3.2 (prefix `model.`; FP8 block weights handled by the entries).

  model.embed_tokens.weight / model.norm.weight / lm_head.weight -> embed_tokens / norm.weight / lm_head.kernel
  model.layers.L.{input,post_attention}_layernorm.weight
  model.layers.L.self_attn.{q_a_proj,q_b_proj (or q_proj),kv_a_proj_with_mqa,o_proj}.weight -> ….kernel
  model.layers.L.self_attn.{q_a_layernorm,kv_a_layernorm}.weight
  model.layers.L.self_attn.kv_b_proj.weight -> k_up_proj + v_up_proj
  model.layers.L.self_attn.indexer.{wq_b,wk,weights_proj}.weight, indexer.k_norm.{weight,bias}
  model.layers.L.mlp.{gate,up,down}_proj.weight (dense layers) -> layers.L.mlp.….kernel
  model.layers.L.mlp.gate.weight, mlp.gate.e_score_correction_bias -> layers.L.block_sparse_moe.{gate,e_score_correction_bias}
  model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight -> layers.L.block_sparse_moe.experts.{gate,up,down} (stacked)
  model.layers.L.mlp.shared_experts.{gate,up,down}_proj.weight -> layers.L.block_sparse_moe.shared_experts.…
  model.layers.N.* with N >= num_hidden_layers (the MTP layer of the release) -> extra (untouched)
"""

from __future__ import annotations

import re

from kimi_jax.config import ModelConfig

from ..entries import Entry
from .builders import cp, indexer_entries, lin, mla_entries, router_entries


def entries(cfg: ModelConfig, names) -> list[Entry]:
    out = [cp("model.embed_tokens.weight", "embed_tokens")]
    for L in range(cfg.num_layers):
        p, t = f"model.layers.{L}.", f"layers.{L}."
        a, ta = p + "self_attn.", t + "self_attn."
        out += [cp(p + "input_layernorm.weight", t + "input_layernorm.weight"),
                cp(p + "post_attention_layernorm.weight", t + "post_attention_layernorm.weight")]
        out += mla_entries(a, ta, cfg.mla)
        if cfg.indexer is not None:
            out += indexer_entries(a, ta)
        if cfg.is_moe_layer(L):
            b, tb = p + "mlp.", t + "block_sparse_moe."
            out += router_entries(b, tb)
            if cfg.moe.num_shared_experts:
                out += [lin(b + f"shared_experts.{n}", tb + f"shared_experts.{n}")
                        for n in ("gate_proj", "up_proj", "down_proj")]
            out += [Entry("experts", b + "experts.{e}." + w + "_proj.weight", (tb + "experts." + w,),
                          num=cfg.moe.num_experts, quantizable=True) for w in ("gate", "up", "down")]
        else:
            out += [lin(p + "mlp." + n, t + "mlp." + n) for n in ("gate_proj", "up_proj", "down_proj")]
    out.append(cp("model.norm.weight", "norm.weight"))
    if not cfg.tie_embeddings:
        out.append(Entry("linear", "lm_head.weight", ("lm_head.kernel",)))
    return out


def extra_predicate(cfg: ModelConfig):
    layer = re.compile(r"^model\.layers\.(\d+)\.")

    def is_extra(name: str) -> bool:
        mt = layer.match(name)
        if mt and int(mt.group(1)) >= cfg.num_layers:  # multi-token-prediction layer(s) of the release
            return True
        return cfg.tie_embeddings and name == "lm_head.weight"

    return is_extra
