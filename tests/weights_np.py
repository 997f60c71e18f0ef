"""Convert kimi_jax parameters (nnx State / modules) into the float64 NumPy weight dicts of np_reference.py.

Layout conversions (ours -> checkpoint / torch, which is what np_reference.py expects):

* Linear ``kernel`` ``[in, out]``  ->  ``[out, in]`` (transpose).
* KDA conv kernels ``[K, P]``      ->  ``[P, 1, K]``.
* KDA ``A_log`` ``[H]``            ->  zero-padded 1-D ``[a_log_checkpoint_size]`` when the config names one (K3
  checkpoints store it padded; the reference slices it back to H), else ``[H]``.
* MLA ``k_up_proj`` ``[R, H, n]`` + ``v_up_proj`` ``[R, H, v]``  ->  ``kv_b_proj`` ``[H*(n+v), R]`` (torch's
  ``[H, n+v, R]`` view, per head rows ``[k_nope | v]``).
* MoE router ``gate`` ``[D, E]``   ->  ``[E, D]``; experts ``gate``/``up`` ``[E, width, F]`` -> ``w1``/``w3`` ``[E, F, width]``,
  ``down`` ``[E, F, width]`` -> ``w2`` ``[E, width, F]`` (stacked dict form accepted by ``np_reference.moe``).
* AttnResMix ``proj_weight`` ``[D]`` -> ``[1, D]`` (the ``Linear(D, 1)`` weight), ``norm_weight`` ``[D]``.
* Indexer LayerNorm -> ``k_norm_weight`` / ``k_norm_bias`` (the names ``np_reference.indexer_scores`` uses).

Everything is returned as float64 numpy arrays.  Config dicts for the reference functions are built from the
kimi_jax dataclass configs by the ``*_ref_cfg`` helpers.
"""

from __future__ import annotations

import numpy as np
from flax import nnx


def _a(x) -> np.ndarray:
    """nnx Variable / jax array / numpy (any float dtype, bf16 included) -> float64 numpy."""
    if isinstance(x, nnx.Variable):
        x = x[...]
    return np.asarray(x).astype(np.float64)


def _lin(mod) -> np.ndarray:
    """A kimi_jax Linear (kernel [in, out]) -> torch weight [out, in]."""
    return _a(mod.kernel).T.copy()


# ------------------------------------------------------------------------------------------------ configs

def kda_ref_cfg(kda_cfg) -> dict:
    return {
        "num_heads": kda_cfg.num_heads,
        "head_dim": kda_cfg.head_dim,
        "gate_form": kda_cfg.gate_form,
        "gate_lower_bound": kda_cfg.gate_lower_bound,
        "norm_eps": kda_cfg.o_norm_eps,
        "l2_eps": 1e-6,
    }


def mla_ref_cfg(mla_cfg, indexer_cfg=None) -> dict:
    d = {
        "num_heads": mla_cfg.num_heads,
        "qk_nope_head_dim": mla_cfg.qk_nope_head_dim,
        "qk_rope_head_dim": mla_cfg.qk_rope_head_dim,
        "v_head_dim": mla_cfg.v_head_dim,
        "kv_lora_rank": mla_cfg.kv_lora_rank,
        "softmax_scale": mla_cfg.softmax_scale,
        "q_a_eps": mla_cfg.q_norm_eps,
        "kv_a_eps": mla_cfg.kv_norm_eps,
        "use_output_gate": bool(mla_cfg.output_gate),
    }
    if mla_cfg.rope is not None:
        raise NotImplementedError("RoPE MLA is not covered by these NumPy conversions")
    if indexer_cfg is not None:
        if indexer_cfg.rope_dims:
            raise NotImplementedError("indexer RoPE is not covered by these NumPy conversions")
        d.update(index_n_heads=indexer_cfg.num_heads, index_head_dim=indexer_cfg.head_dim,
                 index_norm_eps=indexer_cfg.norm_eps, index_topk=indexer_cfg.topk)
    return d


def moe_ref_cfg(moe_cfg, model_cfg=None, *, activation: str = "situ", situ_beta: float = 4.0,
                situ_linear_beta: float = 25.0, norm_eps: float = 1e-5) -> dict:
    if moe_cfg.bias_in_weights:
        raise NotImplementedError("np_reference.router has no bias-in-weights quirk")
    if model_cfg is not None:
        activation, norm_eps = model_cfg.activation, model_cfg.rms_norm_eps
        situ_beta, situ_linear_beta = model_cfg.situ_beta, model_cfg.situ_linear_beta
    return {
        "top_k": moe_cfg.top_k,
        "num_groups": moe_cfg.num_groups,
        "topk_groups": moe_cfg.topk_groups,
        "renormalize": moe_cfg.renormalize,
        "routed_scaling_factor": moe_cfg.routed_scaling_factor,
        "activation": activation,
        "situ_beta": situ_beta,
        "situ_linear_beta": situ_linear_beta,
        "latent": bool(moe_cfg.latent_size),
        "latent_moe_use_norm": bool(moe_cfg.latent_norm),
        "norm_eps": norm_eps,
    }


# ------------------------------------------------------------------------------------------------ modules

def kda_weights(attn, kda_cfg) -> dict:
    """KimiDeltaAttention -> np_reference.kda_layer weights."""
    H = kda_cfg.num_heads
    w = {name: _lin(getattr(attn, name)) for name in ("q_proj", "k_proj", "v_proj", "f_a_proj", "f_b_proj",
                                                      "b_proj", "o_proj")}
    for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
        w[name] = _a(getattr(attn, name)).T[:, None, :].copy()  # [K, P] -> [P, 1, K]
    a_log = _a(attn.A_log)[:H]
    n = kda_cfg.a_log_checkpoint_size
    if n is not None and n > H:
        a_log = np.concatenate([a_log, np.zeros(n - H)])  # K3 checkpoint layout: padded with zeros
    w["A_log"] = a_log
    w["dt_bias"] = _a(attn.dt_bias).reshape(-1)
    w["o_norm"] = _a(attn.o_norm)
    if kda_cfg.output_gate_rank is None:
        w["g_proj"] = _lin(attn.g_proj)
    else:
        w["g_a_proj"], w["g_b_proj"] = _lin(attn.g_a_proj), _lin(attn.g_b_proj)
    return w


def mla_weights(attn, mla_cfg) -> dict:
    """MultiHeadLatentAttention (+ indexer) -> np_reference.mla_attention / mla_with_indexer weights."""
    H, R = mla_cfg.num_heads, mla_cfg.kv_lora_rank
    n, v = mla_cfg.qk_nope_head_dim, mla_cfg.v_head_dim
    w = {}
    if mla_cfg.q_lora_rank is None:
        w["q_proj"] = _lin(attn.q_proj)
    else:
        w["q_a_proj"] = _lin(attn.q_a_proj)
        w["q_a_layernorm"] = _a(attn.q_a_layernorm.weight)
        w["q_b_proj"] = _lin(attn.q_b_proj)
    w["kv_a_proj_with_mqa"] = _lin(attn.kv_a_proj_with_mqa)
    w["kv_a_layernorm"] = _a(attn.kv_a_layernorm.weight)
    k_up = _a(attn.k_up_proj)  # [R, H, n]
    v_up = _a(attn.v_up_proj)  # [R, H, v]
    kvb_hxr = np.concatenate([k_up.transpose(1, 2, 0), v_up.transpose(1, 2, 0)], axis=1)  # [H, n+v, R]
    w["kv_b_proj"] = kvb_hxr.reshape(H * (n + v), R)
    if mla_cfg.output_gate:
        w["g_proj"] = _lin(attn.g_proj)
    w["o_proj"] = _lin(attn.o_proj)
    if getattr(attn, "indexer", None) is not None:
        ix = attn.indexer
        w["indexer"] = {
            "wq_b": _lin(ix.wq_b),
            "wk": _lin(ix.wk),
            "k_norm_weight": _a(ix.k_norm.weight),
            "k_norm_bias": _a(ix.k_norm.bias),
            "weights_proj": _lin(ix.weights_proj),
        }
    return w


def mlp_weights(mlp) -> dict:
    """DenseMLP -> {gate_proj, up_proj, down_proj} (torch orientation)."""
    return {k: _lin(getattr(mlp, k)) for k in ("gate_proj", "up_proj", "down_proj")}


def moe_weights(moe) -> dict:
    """MoE -> np_reference.moe weights (stacked experts)."""
    w = {
        "gate": _a(moe.gate).T.copy(),
        "e_score_correction_bias": _a(moe.e_score_correction_bias),
        "experts": {
            "w1": _a(moe.experts.gate).transpose(0, 2, 1).copy(),  # [E, F, width]
            "w3": _a(moe.experts.up).transpose(0, 2, 1).copy(),
            "w2": _a(moe.experts.down).transpose(0, 2, 1).copy(),  # [E, width, F]
        },
    }
    if moe.cfg.latent_size:
        w["routed_expert_down_proj"] = _lin(moe.routed_expert_down_proj)
        w["routed_expert_up_proj"] = _lin(moe.routed_expert_up_proj)
        if moe.routed_expert_norm is not None:
            w["routed_expert_norm"] = _a(moe.routed_expert_norm.weight)
    if moe.shared_experts is not None:
        w["shared_experts"] = mlp_weights(moe.shared_experts)
    return w


def attn_res_weights(mix) -> tuple[np.ndarray, np.ndarray]:
    """AttnResMix -> (proj [1, D], norm [D])."""
    return _a(mix.proj_weight)[None, :].copy(), _a(mix.norm_weight)


# ------------------------------------------------------------------------------------------------ whole model

def tiny_numpy_weights(model) -> dict:
    """A kimi_jax ``Model`` (e.g. ``load_model("tiny")``) -> nested float64 dict in checkpoint names/orientation.

    Layout::

      {"embed_tokens": [V, D], "norm": [D], "lm_head": [V, D] (None when tied),
       "output_attn_res_proj": [1, D], "output_attn_res_norm": [D],       # AttnRes models only
       "layers": [ {"kind": "kda" | "mla",
                    "input_layernorm", "post_attention_layernorm": [D],
                    "self_attention_res_proj" [1, D], "self_attention_res_norm", "mlp_res_proj", "mlp_res_norm",
                    "self_attn": kda_weights | mla_weights,
                    "mlp": mlp_weights  OR  "block_sparse_moe": moe_weights}, ...],
       "cfg": {"kda": kda_ref_cfg, "mla": mla_ref_cfg (with indexer keys), "moe": moe_ref_cfg,
               "dense_activation", "situ_beta", "situ_linear_beta", "rms_norm_eps", "attn_res_block_size"}}

    The per-layer dicts double as the ``params["layers"]`` entries of ``np_reference.attn_res_forward``.
    """
    cfg = model.config
    m = model.module
    out = {
        "embed_tokens": _a(m.embed_tokens),
        "norm": _a(m.norm.weight),
        "lm_head": None if m.lm_head is None else _lin(m.lm_head),
        "layers": [],
    }
    if cfg.attn_res_block_size:
        out["output_attn_res_proj"], out["output_attn_res_norm"] = attn_res_weights(m.output_attn_res)
    for i, layer in enumerate(m.layers):
        lw = {
            "kind": cfg.layer_kinds[i],
            "input_layernorm": _a(layer.input_layernorm.weight),
            "post_attention_layernorm": _a(layer.post_attention_layernorm.weight),
        }
        if cfg.attn_res_block_size:
            lw["self_attention_res_proj"], lw["self_attention_res_norm"] = attn_res_weights(layer.self_attention_res)
            lw["mlp_res_proj"], lw["mlp_res_norm"] = attn_res_weights(layer.mlp_res)
        if lw["kind"] == "kda":
            lw["self_attn"] = kda_weights(layer.self_attn, cfg.kda)
        else:
            lw["self_attn"] = mla_weights(layer.self_attn, cfg.mla)
        if layer.mlp is not None:
            lw["mlp"] = mlp_weights(layer.mlp)
        else:
            lw["block_sparse_moe"] = moe_weights(layer.block_sparse_moe)
        out["layers"].append(lw)
    out["cfg"] = {
        "kda": kda_ref_cfg(cfg.kda) if cfg.kda is not None else None,
        "mla": mla_ref_cfg(cfg.mla, cfg.indexer),
        "moe": moe_ref_cfg(cfg.moe, cfg),
        "dense_activation": cfg.activation,
        "situ_beta": cfg.situ_beta,
        "situ_linear_beta": cfg.situ_linear_beta,
        "rms_norm_eps": cfg.rms_norm_eps,
        "attn_res_block_size": cfg.attn_res_block_size,
    }
    return out


def numpy_forward(weights: dict, ids_t, ref) -> np.ndarray:
    """float64 forward of one sequence ``ids_t`` ``[T]`` with np_reference functions -> logits ``[T, V]``.

    ``ref`` is the np_reference module (passed in so this file does not touch sys.path).
    """
    c = weights["cfg"]
    layers = weights["layers"]
    eps = c["rms_norm_eps"]

    def attn(L, x):
        lw = layers[L]
        if lw["kind"] == "kda":
            return ref.kda_layer(x, lw["self_attn"], c["kda"])[0]
        if "indexer" in lw["self_attn"]:
            return ref.mla_with_indexer(x, lw["self_attn"], c["mla"])
        return ref.mla_attention(x, lw["self_attn"], c["mla"])

    def ffn(L, x):
        lw = layers[L]
        if "mlp" in lw:
            mw = lw["mlp"]
            return ref.mlp(x, mw["gate_proj"], mw["up_proj"], mw["down_proj"], c["dense_activation"],
                           c["situ_beta"], c["situ_linear_beta"])
        return ref.moe(x, lw["block_sparse_moe"], c["moe"])

    embed = weights["embed_tokens"][np.asarray(ids_t)]
    h = ref.attn_res_forward(embed, attn, ffn, weights, c["attn_res_block_size"], eps)
    head = weights["lm_head"] if weights["lm_head"] is not None else weights["embed_tokens"]
    return ref.linear(h, head)


# ------------------------------------------------------------------------------------------------ fast test init

def _init_value(name: str, parent: str, shape, r: np.random.Generator) -> np.ndarray:
    n = lambda: r.standard_normal(shape)  # noqa: E731
    if parent == "experts":                                 # routed experts' gate / up / down
        return n() * shape[1] ** -0.5                       # [E, in, out]
    if name == "kernel" or name in ("gate", "k_up_proj", "v_up_proj"):
        return n() * shape[0] ** -0.5                       # [in, ...]
    if name.endswith("_conv1d"):
        return n() * shape[0] ** -0.5                       # [K, P]
    if name == "A_log":
        return np.log(r.uniform(1.0, 16.0, shape))
    if name == "dt_bias":
        return n() * 0.5 - 1.0
    if name == "e_score_correction_bias":
        return 0.3 * n()                                    # large enough to change selections
    if name == "proj_weight":
        return 3.0 * n() * shape[0] ** -0.5                 # AttnRes pseudo-query: a clearly non-uniform softmax
    if name == "bias":
        return 0.1 * n()
    if name in ("weight", "o_norm", "norm_weight"):
        return 1.0 + 0.1 * n()
    if name == "embed_tokens":
        return n()
    raise KeyError(f"numpy_init has no rule for parameter {parent}.{name} {tuple(shape)}")


def numpy_init(factory, seed: int = 0):
    """Build ``factory()`` (an nnx module constructor) abstractly and fill its parameters from NumPy.

    Avoids ``jax.random`` in module constructors, whose per-shape compiles cost ~0.35 s each on CPU. Scales follow
    the modules' own initialisation (std in^-0.5, norm weights near 1), with a larger router bias and AttnRes
    pseudo-query so that those features visibly matter.
    """
    import jax
    import jax.numpy as jnp

    abstract = nnx.eval_shape(factory)
    graphdef, state = nnx.split(abstract)
    r = np.random.default_rng(seed)

    def fill(path, leaf):
        keys = [getattr(p, "key", getattr(p, "name", None)) for p in path]
        keys = [k for k in keys if k != "value"]
        name, parent = str(keys[-1]), str(keys[-2]) if len(keys) > 1 else ""
        return jnp.asarray(_init_value(name, parent, leaf.shape, r), leaf.dtype)

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(fill, state))
