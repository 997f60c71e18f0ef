"""Entry builders shared by the per-architecture name maps (`kimi.py`, `deepseek.py`)."""

from __future__ import annotations

from ..entries import Entry


def lin(src: str, target: str, quantizable: bool = True) -> Entry:
    """A linear layer: HF `src.weight` [out, in] -> kimi_jax `target.kernel` [in, out]."""
    return Entry("linear", src + ".weight", (target + ".kernel",), quantizable=quantizable)


def cp(src: str, target: str) -> Entry:
    """A tensor copied as it is."""
    return Entry("copy", src, (target,))


def mla_entries(attn: str, target: str, mla) -> list[Entry]:
    """An MLA layer's projections (K3 / Kimi-Linear / DeepSeek-V3.2 name them the same way): the q path (plain or
    LoRA), the compressed kv path, `kv_b_proj` split into `k_up_proj` / `v_up_proj`, `o_proj`, and the K3 output gate.
    `attn` / `target`: the HF and kimi_jax `self_attn.` prefixes; `mla`: the layer's `MLAConfig`."""
    a, ta = attn, target
    if mla.q_lora_rank is None:
        out = [lin(a + "q_proj", ta + "q_proj")]
    else:
        out = [lin(a + "q_a_proj", ta + "q_a_proj"), cp(a + "q_a_layernorm.weight", ta + "q_a_layernorm.weight"),
               lin(a + "q_b_proj", ta + "q_b_proj")]
    out += [lin(a + "kv_a_proj_with_mqa", ta + "kv_a_proj_with_mqa"),
            cp(a + "kv_a_layernorm.weight", ta + "kv_a_layernorm.weight"),
            Entry("kv_b", a + "kv_b_proj.weight", (ta + "k_up_proj", ta + "v_up_proj"), qbase=ta + "kv_b_proj",
                  quantizable=True),
            lin(a + "o_proj", ta + "o_proj")]
    if mla.output_gate:
        out.append(lin(a + "g_proj", ta + "g_proj"))
    return out


def indexer_entries(attn: str, target: str) -> list[Entry]:
    """The DSA lightning indexer below an MLA layer (K3.1 and DeepSeek-V3.2 name it the same way).

    `attn` / `target`: the HF and kimi_jax `self_attn.` prefixes of the layer. `weights_proj` (the per-head score
    weights) is never quantised: it is tiny and its output scales every head's score."""
    i, t = attn + "indexer.", target + "indexer."
    return [lin(i + "wq_b", t + "wq_b"), lin(i + "wk", t + "wk"),
            cp(i + "k_norm.weight", t + "k_norm.weight"), cp(i + "k_norm.bias", t + "k_norm.bias"),
            lin(i + "weights_proj", t + "weights_proj", quantizable=False)]


def router_entries(moe: str, target: str) -> list[Entry]:
    """The MoE router: `gate.weight` [E, D] -> `gate` [D, E] (a plain array, not a `.kernel`: the router is no
    `Linear` module) and the selection bias `gate.e_score_correction_bias`. `moe` / `target`: the HF MoE prefix
    (`mlp.` for DeepSeek, `block_sparse_moe.` for Kimi) and the kimi_jax `block_sparse_moe.` prefix."""
    return [Entry("linear", moe + "gate.weight", (target + "gate",)),
            cp(moe + "gate.e_score_correction_bias", target + "e_score_correction_bias")]
