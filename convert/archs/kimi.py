"""Name map of the Kimi family: K3 / K3.1 (`language_model.` prefix, vision tower carried through) and Kimi-Linear.

HF name (below the text prefix `language_model.model.` or `model.`)       -> kimi_jax parameter
  embed_tokens.weight                                   -> embed_tokens                      (copy)
  norm.weight                                           -> norm.weight
  output_attn_res_{norm,proj}.weight                    -> output_attn_res.{norm,proj}_weight ([1,D] -> [D])
  layers.L.{input,post_attention}_layernorm.weight      -> layers.L.….weight
  layers.L.{self_attention,mlp}_res_{norm,proj}.weight  -> layers.L.{self_attention,mlp}_res.{norm,proj}_weight
  KDA  layers.L.self_attn.{q,k,v,f_a,f_b,b,g,g_a,g_b,o}_proj.weight -> ….kernel (transposed)
       layers.L.self_attn.{q,k,v}_conv1d.weight [P,1,K] -> layers.L.self_attn.{q,k,v}_conv1d [K,P]
       layers.L.self_attn.A_log ([128] padded or [1,1,H,1]) -> A_log [H];  dt_bias [P];  o_norm.weight -> o_norm
  MLA  layers.L.self_attn.{q_proj | q_a_proj,q_a_layernorm,q_b_proj}, kv_a_proj_with_mqa, kv_a_layernorm,
       kv_b_proj -> k_up_proj + v_up_proj,  g_proj (K3 output gate), o_proj;
       indexer.{wq_b,wk,weights_proj}.weight, indexer.k_norm.{weight,bias}
  FFN  layers.L.mlp.{gate,up,down}_proj.weight (dense; transformers' save_pretrained writes
       block_sparse_moe.{gate,up,down}_proj for Kimi-Linear: both accepted, the name found is kept for export)
       layers.L.block_sparse_moe.gate.weight [E,D] -> block_sparse_moe.gate [D,E]; gate.e_score_correction_bias;
       routed_expert_{down,up}_proj, routed_expert_norm (K3 latent MoE); shared_experts.{gate,up,down}_proj;
       experts.E.w{1,3,2}.weight (or .weight_packed + .weight_scale, MXFP4) -> experts.{gate,up,down} stacked
  lm_head.weight (language_model.lm_head.weight for K3) -> lm_head.kernel
  vision_tower.*, mm_projector.*                        -> extra (untouched)
"""

from __future__ import annotations

from kimi_jax.config import ModelConfig

from ..entries import Entry
from .builders import cp, indexer_entries, lin, mla_entries, router_entries

TEXT_PREFIXES = (("language_model.model.", "language_model.lm_head.weight"), ("model.", "lm_head.weight"))
EXTRA_PREFIXES = ("vision_tower.", "mm_projector.")


def _present(names, base: str) -> bool:
    return base in names or base + "_packed" in names


def text_prefix(cfg: ModelConfig, names) -> tuple[str, str]:
    for prefix, head in TEXT_PREFIXES:
        if prefix + "embed_tokens.weight" in names:
            return prefix, head
    # nothing found: report the name the architecture normally uses
    return TEXT_PREFIXES[0] if cfg.architecture in ("kimi_k3", "kimi_k31") else TEXT_PREFIXES[1]


def entries(cfg: ModelConfig, names) -> list[Entry]:
    names = set(names)
    pre, head = text_prefix(cfg, names)
    D = cfg.hidden_size
    out = [cp(pre + "embed_tokens.weight", "embed_tokens")]
    for L, kind in enumerate(cfg.layer_kinds):
        p, t = f"{pre}layers.{L}.", f"layers.{L}."
        out += [cp(p + "input_layernorm.weight", t + "input_layernorm.weight"),
                cp(p + "post_attention_layernorm.weight", t + "post_attention_layernorm.weight")]
        if cfg.attn_res_block_size:
            for mix in ("self_attention_res", "mlp_res"):
                out += [cp(p + f"{mix}_norm.weight", t + f"{mix}.norm_weight"),
                        Entry("reshape", p + f"{mix}_proj.weight", (t + f"{mix}.proj_weight",),
                              allowed_shapes=((1, D),))]
        a = p + "self_attn."
        ta = t + "self_attn."
        if kind == "kda":
            k = cfg.kda
            P = k.proj_dim
            for n in ("q_proj", "k_proj", "v_proj", "f_a_proj", "f_b_proj", "b_proj", "o_proj"):
                out.append(lin(a + n, ta + n))
            gates = ("g_proj",) if k.output_gate_rank is None else ("g_a_proj", "g_b_proj")
            out += [lin(a + n, ta + n) for n in gates]
            out += [Entry("conv", a + f"{c}_conv1d.weight", (ta + f"{c}_conv1d",)) for c in "qkv"]
            shapes = [(k.num_heads,), (1, 1, k.num_heads, 1)]
            if k.a_log_checkpoint_size and k.a_log_checkpoint_size != k.num_heads:
                shapes.append((k.a_log_checkpoint_size,))
            out += [Entry("a_log", a + "A_log", (ta + "A_log",), allowed_shapes=tuple(shapes)),
                    Entry("reshape", a + "dt_bias", (ta + "dt_bias",), allowed_shapes=((P,),)),
                    cp(a + "o_norm.weight", ta + "o_norm")]
        else:
            out += mla_entries(a, ta, cfg.mla)
            if cfg.indexer is not None:
                out += indexer_entries(a, ta)
        if cfg.is_moe_layer(L):
            b, tb = p + "block_sparse_moe.", t + "block_sparse_moe."
            out += router_entries(b, tb)
            if cfg.moe.latent_size:
                out += [lin(b + "routed_expert_down_proj", tb + "routed_expert_down_proj"),
                        lin(b + "routed_expert_up_proj", tb + "routed_expert_up_proj")]
                if cfg.moe.latent_norm:
                    out.append(cp(b + "routed_expert_norm.weight", tb + "routed_expert_norm.weight"))
            if cfg.moe.num_shared_experts:
                out += [lin(b + f"shared_experts.{n}", tb + f"shared_experts.{n}")
                        for n in ("gate_proj", "up_proj", "down_proj")]
            out += [Entry("experts", b + "experts.{e}." + hf + ".weight", (tb + "experts." + w,),
                          num=cfg.moe.num_experts, quantizable=True)
                    for hf, w in (("w1", "gate"), ("w3", "up"), ("w2", "down"))]
        else:
            mlp = "mlp."
            if not _present(names, p + "mlp.gate_proj.weight") and _present(names, p + "block_sparse_moe.gate_proj.weight"):
                mlp = "block_sparse_moe."  # what transformers' save_pretrained writes for Kimi-Linear
            out += [lin(p + mlp + n, t + "mlp." + n) for n in ("gate_proj", "up_proj", "down_proj")]
    out.append(cp(pre + "norm.weight", "norm.weight"))
    if cfg.attn_res_block_size:
        out += [cp(pre + "output_attn_res_norm.weight", "output_attn_res.norm_weight"),
                Entry("reshape", pre + "output_attn_res_proj.weight", ("output_attn_res.proj_weight",),
                      allowed_shapes=((1, D),))]
    if not cfg.tie_embeddings:
        out.append(Entry("linear", head, ("lm_head.kernel",)))
    return out


def extra_predicate(cfg: ModelConfig):
    def is_extra(name: str) -> bool:
        if name.startswith(EXTRA_PREFIXES):
            return True
        return cfg.tie_embeddings and name in ("lm_head.weight", "language_model.lm_head.weight")

    return is_extra
