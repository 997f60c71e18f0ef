"""Tiny random Hugging Face reference models for parity tests (CPU, float32, eager attention).

The builders create *tiny* `KimiLinearForCausalLM` / `DeepseekV32ForCausalLM` models from transformers 5.23,
re-initialise every parameter with a seeded, O(1)-activation scheme (so that parameters that HF initialises to
0 or 1 -- norm weights, LayerNorm bias, `e_score_correction_bias`, `dt_bias`, `A_log` -- actually matter), save
them with ``save_pretrained(dir, safe_serialization=True)`` (transformers reverts its load-time conversions on
save, so the files use the *original* checkpoint names, see tests/HF_REFERENCE_NOTES.md), and return
``(model, config)``.

`reference_logits` runs one full causal forward; `reference_decode_logits` prefills then decodes one token at a
time through the HF cache. Both return float32 numpy ``[B, T, vocab]``.

`deepseek_indexer_selection` re-derives the DSA indexer scores of every layer (and checks them against the indices
HF actually selected), so tests can (a) compare a JAX indexer directly and (b) skip inputs whose top-k has an exact
tie at the selection boundary (ReLU makes exact-zero scores common; tie-breaking is implementation-defined).

torch / transformers are imported lazily so that importing this module never fails; tests should do
``pytest.importorskip("transformers")`` first.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

__all__ = [
    "KIMI_LINEAR_DEFAULTS",
    "DEEPSEEK_V32_DEFAULTS",
    "make_kimi_linear",
    "make_deepseek_v32",
    "reference_logits",
    "reference_decode_logits",
    "deepseek_indexer_selection",
    "saved_tensor_table",
    "random_input_ids",
]

# --------------------------------------------------------------------------------------------------------------
# Default tiny configurations (any key can be overridden through **overrides of the builders).
# --------------------------------------------------------------------------------------------------------------

KIMI_LINEAR_DEFAULTS: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,  # dense MLP of layer 0 (first_k_dense_replace=1)
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=2,  # MLA heads
    num_key_value_heads=2,  # must equal num_attention_heads (kv_b_proj already yields one k/v per head)
    kv_lora_rank=32,
    q_lora_rank=None,  # Kimi-Linear has no q LoRA; pass an int (e.g. 24) for the q_a/q_b variant
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,  # NoPE: these dims are NOT rotated in Kimi-Linear
    v_head_dim=16,
    num_experts=8,
    num_experts_per_token=2,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=2.446,
    norm_topk_prob=True,
    rms_norm_eps=1e-5,
    hidden_act="silu",
    first_k_dense_replace=1,
    tie_word_embeddings=False,
    max_position_embeddings=4096,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    # 1-indexed, like the released checkpoints: layers 0,1,3 (0-indexed) are KDA, layer 2 is MLA.
    linear_attn_config=dict(
        num_heads=2,
        head_dim=16,
        short_conv_kernel_size=4,
        kda_layers=[1, 2, 4],
        full_attn_layers=[3],
    ),
)

DEEPSEEK_V32_DEFAULTS: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,  # dense MLP of the first `first_k_dense_replace` layers
    moe_intermediate_size=32,
    num_hidden_layers=3,
    first_k_dense_replace=1,  # layer 0 dense, layers 1..2 MoE
    num_attention_heads=2,
    num_key_value_heads=2,
    q_lora_rank=24,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=2,  # shared expert width = moe_intermediate_size * n_shared_experts = 64
    n_group=4,  # grouped routing on: 4 groups of 2 experts, keep the best 2 groups
    topk_group=2,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    tie_word_embeddings=False,
    max_position_embeddings=128,
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=4.0,
        original_max_position_embeddings=32,
        beta_fast=32,
        beta_slow=1,
        mscale=1.0,
        mscale_all_dim=1.0,
    ),
    index_n_heads=2,
    index_head_dim=16,
    index_topk=4,  # small, so the DSA mask is active for every query past position 3
    pad_token_id=None,
    bos_token_id=0,
    eos_token_id=1,
)


def _torch():
    import torch  # noqa: PLC0415

    return torch


# --------------------------------------------------------------------------------------------------------------
# Parameter randomisation
# --------------------------------------------------------------------------------------------------------------


def _randomize_(model, seed: int) -> None:
    """Seeded re-initialisation of every parameter and persistent buffer.

    Matrices ~ N(0, 1/fan_in) (fan_in = last dim) so activations stay O(1); embeddings N(0, 1);
    norm weights U(0.5, 1.5); norm biases N(0, 0.1^2); conv taps N(0, 0.5^2);
    e_score_correction_bias N(0, 0.1^2) (sigmoid scores are in (0,1), so this changes selections);
    A_log = log U(1, 16); dt_bias ~ N(-2, 1) (g = -exp(A_log) * softplus(f + dt_bias) spans weak..strong decay).
    """
    torch = _torch()
    gen = torch.Generator().manual_seed(int(seed) + 12345)

    def normal(shape, std, mean=0.0):
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std + mean

    def uniform(shape, lo, hi):
        return torch.rand(shape, generator=gen, dtype=torch.float32) * (hi - lo) + lo

    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            leaf = name.rsplit(".", 1)[-1]
            shape = tuple(p.shape)
            if name.endswith("A_log"):
                val = torch.log(uniform(shape, 1.0, 16.0))
            elif name.endswith("dt_bias"):
                val = normal(shape, 1.0, mean=-2.0)
            elif "conv1d" in name:
                val = normal(shape, 0.5)
            elif "embed_tokens" in name:
                val = normal(shape, 1.0)
            elif p.ndim == 1 and leaf == "bias":
                val = normal(shape, 0.1)
            elif p.ndim == 1:  # RMSNorm / LayerNorm / gated-norm weights
                val = uniform(shape, 0.5, 1.5)
            else:  # Linear [out, in], packed experts [E, out, in], router [E, D]
                val = normal(shape, 1.0 / math.sqrt(shape[-1]))
            p.copy_(val.to(p.dtype))
        for name, b in sorted(model.named_buffers(), key=lambda kv: kv[0]):
            if name.endswith("e_score_correction_bias"):
                b.copy_(normal(tuple(b.shape), 0.1).to(b.dtype))


def _finish(model, config, dir, seed):
    torch = _torch()
    model = model.to(torch.float32).eval()
    _randomize_(model, seed)
    if dir is not None:
        os.makedirs(dir, exist_ok=True)
        model.save_pretrained(dir, safe_serialization=True)
    return model, config


# --------------------------------------------------------------------------------------------------------------
# Builders
# --------------------------------------------------------------------------------------------------------------


def make_kimi_linear(dir, seed: int = 0, **overrides):
    """Build, randomise and save a tiny `KimiLinearForCausalLM`. Returns ``(model, config)``.

    ``overrides`` update `KIMI_LINEAR_DEFAULTS`; a ``linear_attn_config`` override is merged key by key.
    ``dir=None`` skips saving.
    """
    torch = _torch()
    from transformers import KimiLinearConfig, KimiLinearForCausalLM  # noqa: PLC0415

    kw = dict(KIMI_LINEAR_DEFAULTS)
    lac = dict(kw["linear_attn_config"])
    lac.update(overrides.pop("linear_attn_config", {}) or {})
    kw.update(overrides)
    kw["linear_attn_config"] = lac
    if kw.get("num_key_value_heads") != kw["num_attention_heads"]:
        raise ValueError("KimiLinearAttention needs num_key_value_heads == num_attention_heads")
    config = KimiLinearConfig(**kw)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = KimiLinearForCausalLM(config)
    return _finish(model, config, dir, seed)


def make_deepseek_v32(dir, seed: int = 0, **overrides):
    """Build, randomise and save a tiny `DeepseekV32ForCausalLM`. Returns ``(model, config)``.

    ``overrides`` update `DEEPSEEK_V32_DEFAULTS` (e.g. ``n_group=1, topk_group=1`` for ungrouped routing,
    ``rope_parameters=dict(rope_type="default", rope_theta=10000.0)`` for plain RoPE). ``dir=None`` skips saving.

    ``antipodal_indexer_heads`` (default True, not a config key): after randomisation the indexer ``wq_b`` rows of head
    ``h + Hi/2`` are set to minus those of head ``h``, so no DSA index score is exactly 0 and the top-k has no ties
    (with free random weights ties are frequent and HF's own decode then disagrees with its full forward; see
    HF_REFERENCE_NOTES.md section 4.1). Pass False for unconstrained weights.
    """
    torch = _torch()
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM  # noqa: PLC0415

    antipodal = overrides.pop("antipodal_indexer_heads", True)
    kw = dict(DEEPSEEK_V32_DEFAULTS)
    if "rope_parameters" in kw:
        kw["rope_parameters"] = dict(kw["rope_parameters"])
    kw.update(overrides)
    config = DeepseekV32Config(**kw)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = DeepseekV32ForCausalLM(config)
    if antipodal and config.index_n_heads % 2:
        raise ValueError("antipodal_indexer_heads needs an even index_n_heads (or pass antipodal_indexer_heads=False)")

    def make_tie_free(m):
        # Exact-zero index scores (every head's ReLU clipped) are common with few heads and make the top-k boundary
        # a tie whose resolution is implementation-defined (HF's own decode then disagrees with its full forward).
        # Head h + H/2 gets the negated wq_b rows of head h, so for every key one of the two has q.k > 0: no score is
        # exactly zero and ties have probability 0. weights_proj stays independent per head.
        if antipodal:
            H, Dh = config.index_n_heads, config.index_head_dim
            with torch.no_grad():
                for layer in m.model.layers:
                    w = layer.self_attn.indexer.wq_b.weight.view(H, Dh, -1)
                    w[H // 2 :] = -w[: H // 2]
        return m

    model, config = _finish(model, config, None, seed)
    make_tie_free(model)
    if dir is not None:
        os.makedirs(dir, exist_ok=True)
        model.save_pretrained(dir, safe_serialization=True)
    return model, config


# --------------------------------------------------------------------------------------------------------------
# Reference outputs
# --------------------------------------------------------------------------------------------------------------


def _as_ids(input_ids):
    torch = _torch()
    ids = torch.as_tensor(np.asarray(input_ids), dtype=torch.long)
    if ids.ndim == 1:
        ids = ids[None]
    return ids


def random_input_ids(vocab_size: int, batch: int, length: int, seed: int = 0) -> np.ndarray:
    """Deterministic int64 token ids ``[batch, length]``."""
    return np.random.default_rng(seed).integers(0, vocab_size, size=(batch, length), dtype=np.int64)


def reference_logits(model, input_ids) -> np.ndarray:
    """Full causal forward (no cache). Returns float32 numpy ``[B, T, vocab]``."""
    torch = _torch()
    ids = _as_ids(input_ids)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False)
    return out.logits.float().cpu().numpy()


def reference_decode_logits(model, input_ids, n_prefill: int) -> np.ndarray:
    """Prefill ``input_ids[:, :n_prefill]`` with ``use_cache=True``, then feed the remaining tokens one at a time
    with the returned cache. Returns the stacked per-position logits, float32 numpy ``[B, T, vocab]``.

    KDA layers: prefill uses the chunked (C=64) algorithm, the 1-token steps the recurrent one (fp32 state).
    MLA/DSA layers: the compressed latent, k_rope and indexer keys are cached; the indexer re-scores all cached keys.
    """
    torch = _torch()
    ids = _as_ids(input_ids)
    T = ids.shape[1]
    if not 1 <= n_prefill <= T:
        raise ValueError(f"n_prefill must be in [1, {T}], got {n_prefill}")
    outs = []
    with torch.no_grad():
        out = model(input_ids=ids[:, :n_prefill], use_cache=True)
        outs.append(out.logits)
        cache = out.past_key_values
        for t in range(n_prefill, T):
            out = model(input_ids=ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            outs.append(out.logits)
            cache = out.past_key_values
    return torch.cat(outs, dim=1).float().cpu().numpy()


def deepseek_indexer_selection(model, input_ids) -> list[dict[str, np.ndarray]]:
    """Per layer of a `DeepseekV32ForCausalLM`, the DSA indexer data of one full forward:

    ``scores``  float32 ``[B, T, T]`` index scores with the causal mask already added (HF adds the float mask,
                i.e. finfo(float32).min, at future positions);
    ``indices`` int ``[B, T, k]`` what HF's `topk` returned, k = min(index_topk, T);
    ``selected`` bool ``[B, T, T]`` the keys kept (selected AND causal);
    ``boundary_tie`` bool ``[B, T]`` True where the k-th and (k+1)-th best *causal* scores are exactly equal, i.e. the
                kept set depends on tie-breaking (skip such inputs in strict parity tests).
    The scores are recomputed from the hook's inputs with the formula in HF_REFERENCE_NOTES.md, and the function
    asserts that their top-k set equals HF's selection wherever there is no boundary tie.
    """
    torch = _torch()
    import torch.nn.functional as F  # noqa: PLC0415
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as mdl  # noqa: PLC0415

    records: list[dict[str, np.ndarray]] = []

    def hook(mod, args, kwargs, output):
        hidden_states, q_resid, (cos, sin), attention_mask = args[:4]
        B, S, _ = hidden_states.shape
        q = mod.wq_b(q_resid).view(B, S, mod.n_heads, mod.head_dim)
        r = mod.qk_rope_head_dim
        k = mod.k_norm(mod.wk(hidden_states))  # [B, S, D]
        # half-split ("rotate_half") RoPE on the first r dims of q (per head) and k
        c, s_ = cos[:, :, None, :], sin[:, :, None, :]
        q_rot = q[..., :r] * c + mdl.rotate_half(q[..., :r]) * s_
        k_rot = k[..., :r] * cos + mdl.rotate_half(k[..., :r]) * sin
        q = torch.cat([q_rot, q[..., r:]], -1)
        k = torch.cat([k_rot, k[..., r:]], -1)
        sc = F.relu(torch.einsum("bshd,btd->bsht", q.float(), k.float()) * mod.softmax_scale)
        w = mod.weights_proj(hidden_states).float() * mod.n_heads**-0.5
        scores = torch.einsum("bsh,bsht->bst", w, sc) + attention_mask
        kk = output.shape[-1]
        idx = output.long()
        selected = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, idx, True)
        causal = attention_mask == 0
        selected &= causal
        masked = scores.masked_fill(~causal, float("-inf"))
        srt = masked.sort(-1, descending=True).values
        n_valid = causal.sum(-1)
        tie = torch.zeros(B, S, dtype=torch.bool)
        has_next = n_valid > kk
        if kk < srt.shape[-1]:
            tie = has_next & (srt[..., kk - 1] == srt[..., kk])
        mine = torch.zeros_like(selected).scatter(-1, masked.topk(kk, -1).indices, True) & causal
        ok = (mine == selected).all(-1) | tie
        assert bool(ok.all()), "indexer score re-derivation disagrees with HF's selection"
        records.append(
            dict(
                scores=scores.float().numpy(),
                indices=output.numpy(),
                selected=selected.numpy(),
                boundary_tie=tie.numpy(),
            )
        )

    handles = [
        layer.self_attn.indexer.register_forward_hook(hook, with_kwargs=True) for layer in model.model.layers
    ]
    try:
        reference_logits(model, input_ids)
    finally:
        for h in handles:
            h.remove()
    return records


def saved_tensor_table(dir) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) of every tensor in the safetensors files of ``dir``, sorted by name."""
    from safetensors import safe_open  # noqa: PLC0415

    rows = []
    for fn in sorted(os.listdir(dir)):
        if fn.endswith(".safetensors"):
            with safe_open(os.path.join(dir, fn), framework="np") as f:
                for k in f.keys():
                    sl = f.get_slice(k)
                    rows.append((k, tuple(sl.get_shape()), str(sl.get_dtype())))
    return sorted(rows)
