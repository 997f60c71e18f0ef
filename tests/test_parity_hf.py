"""Parity with code nobody here wrote: transformers 5.23's `KimiLinearForCausalLM` and `DeepseekV32ForCausalLM`.

Tiny random models (tests/hf_fixtures.py) -> save_pretrained -> `convert` -> `kimi_jax.load_model`; our logits
against theirs in float32 (relative L2 error <= 1e-4 and identical argmax), for the full forward (`Model.logits`)
and for prefill + one-token decode steps (`Model.prefill` / `Model.decode_step`) against their full forward.

Covered: prompts shorter (5 / 12) and longer (66 / 70: two KDA chunks of 64) than a chunk; two seeds; nonzero
`e_score_correction_bias` and `dt_bias` (the fixtures randomise them); strong KDA decay; Kimi-Linear with and
without q LoRA and with grouped routing; DeepSeek YaRN (default attention factor, mscale != mscale_all_dim,
mscale alone, untruncated correction range), plain RoPE with ungrouped routing, indexer top-k 4 < prompt length;
FP8 block weights kept in the checkpoint and dequantised at load.

Compile budget: one `Model` (one set of jitted functions) per distinct config; other seeds / weights of the same
config swap their parameters into it (`_same_jit`), so a new seed costs no compile. Shapes: logits [2, 70];
prefill [2, 5] and [2, 66] into a 70-token cache; decode [2, 1]. The variant configs (marked slow) only prefill and
decode, which also checks the prefill's full-forward logits of the prompt.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

import kimi_jax
from kimi_jax.checkpoint import convert_checkpoint as convert

H = pytest.importorskip("hf_fixtures")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

REL_TOL = 1e-4
MAX_LEN = 70
RESULTS: dict = {}  # case -> worst relative error (printed at the end with -s)


def _rel(ours, ref) -> float:
    return float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))


def _check(ours, ref, case):
    assert ours.shape == ref.shape and np.all(np.isfinite(ours))
    rel = _rel(ours, ref)
    RESULTS[case] = max(rel, RESULTS.get(case, 0.0))
    assert rel <= REL_TOL, f"{case}: relative L2 error {rel:.2e}"
    np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1), err_msg=case)


def _same_jit(base, other):
    """`other`'s parameters evaluated by `base`'s jitted functions (same config, so no recompilation)."""
    assert other.config == base.config
    m = copy.copy(base)
    m.params = other.params
    return m


def _decode(model, ids, n_prefill):
    logits, cache = model.prefill(ids[:, :n_prefill], MAX_LEN)
    steps = [np.asarray(logits, np.float32)]
    for t in range(n_prefill, ids.shape[1]):
        lg, cache = model.decode_step(cache, ids[:, t])
        steps.append(np.asarray(lg, np.float32)[:, None])
    assert np.asarray(cache.length).tolist() == [ids.shape[1]] * ids.shape[0]
    return np.concatenate(steps, axis=1)


def _build(kind, root, name, seed, edit=None, **overrides):
    """HF model + its converted checkpoint + our model loaded from it."""
    make = H.make_kimi_linear if kind == "kl" else H.make_deepseek_v32
    hf_dir, dst = root / f"{name}_hf", root / f"{name}_jax"
    hf, cfg = make(None if edit else str(hf_dir), seed=seed, **overrides)
    if edit is not None:
        edit(hf)
        hf.save_pretrained(str(hf_dir))
    convert(str(hf_dir), str(dst), dtype="keep", progress=False)
    return hf, kimi_jax.load_model(str(dst)), hf_dir


class Family:
    """One config: the first seed's model owns the compiled functions, the others reuse them."""

    def __init__(self, kind, root, name, seeds=(0, 1), **overrides):
        self.kind, self.root, self.name, self.overrides = kind, root, name, overrides
        self.cases, self.base = {}, None
        for s in seeds:
            self.add(s, s)

    def add(self, key, seed, edit=None):
        hf, ours, hf_dir = _build(self.kind, self.root, f"{self.name}_{key}", seed, edit, **self.overrides)
        if self.base is None:
            self.base = ours
        else:
            ours = _same_jit(self.base, ours)
        self.cases[key] = (hf, ours, hf_dir)
        return self.cases[key]

    def ids(self, T, seed):
        return H.random_input_ids(256, 2, T, seed=1000 + seed + T)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("parity")


@pytest.fixture(scope="module")
def kimi(root):
    return Family("kl", root, "kl")


@pytest.fixture(scope="module")
def deepseek(root):
    return Family("ds", root, "ds")


# ------------------------------------------------------------------------------------------------- Kimi-Linear

def _nonzero_biases(model):
    """The fixtures randomise e_score_correction_bias and dt_bias (HF initialises them to zero)."""
    import jax

    seen = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(model.params)[0]:
        name = jax.tree_util.keystr(path)
        if "e_score_correction_bias" in name or "dt_bias" in name:
            assert np.all(np.asarray(leaf) != 0), name
            seen += 1
    assert seen


@pytest.mark.parametrize("seed", [0, 1])
def test_kimi_linear_logits(kimi, seed, T=70):
    hf, ours, _ = kimi.cases[seed]
    _nonzero_biases(ours)
    ids = kimi.ids(T, seed)
    _check(ours.logits(ids), H.reference_logits(hf, ids), f"kimi_linear logits T={T} seed={seed}")


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("n_prefill,T", [(5, 12), (66, 70)])
def test_kimi_linear_prefill_decode(kimi, seed, n_prefill, T):
    hf, ours, _ = kimi.cases[seed]
    ids = kimi.ids(T, seed)
    _check(_decode(ours, ids, n_prefill), H.reference_logits(hf, ids),
           f"kimi_linear decode {n_prefill}+{T - n_prefill} seed={seed}")


def test_kimi_linear_strong_decay(kimi):
    """Decay of ~e^-100 per step (A_log = log 16, f + dt_bias >= ~4): exponents over a chunk reach ~-6000."""

    def strong(hf):
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if name.endswith("dt_bias"):
                    p.add_(8.0)
                elif name.endswith("A_log"):
                    p.fill_(float(np.log(16.0)))

    hf, ours, _ = kimi.add("strong", 3, edit=strong)
    ids = kimi.ids(70, 3)
    ref = H.reference_logits(hf, ids)
    _check(ours.logits(ids), ref, "kimi_linear strong decay logits")
    _check(_decode(ours, ids, 66), ref, "kimi_linear strong decay decode")


def test_kimi_linear_tie_word_embeddings_true_still_uses_lm_head(kimi, root):
    """transformers' KimiLinearForCausalLM never ties: with tie_word_embeddings=True it saves and uses its own
    lm_head.weight, and so do we (the config is the untied one, so the compiled functions are shared)."""
    hf, ours, _ = _build("kl", root, "kl_tied", 5, tie_word_embeddings=True)
    ids = kimi.ids(12, 5)
    _check(_same_jit(kimi.base, ours).logits(ids), H.reference_logits(hf, ids), "kimi_linear tied-flag logits")


@pytest.mark.slow
def test_kimi_linear_q_lora_grouped_routing(root):
    """q LoRA (q_a_proj / q_a_layernorm eps 1e-6 / q_b_proj), 4 expert groups keep 2, 2 shared experts; two layers
    (KDA + dense MLP, MLA + MoE) to keep the compile short."""
    fam = Family("kl", root, "kl_qlora", seeds=(2,), q_lora_rank=24, num_expert_group=4, topk_group=2,
                 n_shared_experts=2, num_hidden_layers=2,
                 linear_attn_config=dict(kda_layers=[1], full_attn_layers=[2]))
    hf, ours, _ = fam.cases[2]
    assert ours.config.mla.q_lora_rank == 24 and ours.config.moe.num_groups == 4
    assert ours.config.layer_kinds == ("kda", "mla") and ours.config.dense_layers == (0,)
    ids = fam.ids(70, 2)
    _check(_decode(ours, ids, 66), H.reference_logits(hf, ids), "kimi_linear q_lora+groups prefill+decode")


# ------------------------------------------------------------------------------------------------- DeepSeek-V3.2

@pytest.mark.parametrize("seed", [0, 1])
def test_deepseek_logits(deepseek, seed, T=70):
    hf, ours, _ = deepseek.cases[seed]
    _nonzero_biases(ours)
    ids = deepseek.ids(T, seed)
    assert ours.config.indexer.topk < T and ours.config.moe.num_groups == 4
    assert ours.config.mla.rope.yarn_factor == 4.0
    # the fixture's antipodal indexer heads make the top-k free of ties (HF_REFERENCE_NOTES.md §4.1)
    assert not any(r["boundary_tie"].any() for r in H.deepseek_indexer_selection(hf, ids))
    _check(ours.logits(ids), H.reference_logits(hf, ids), f"deepseek logits T={T} seed={seed}")


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("n_prefill,T", [(5, 12), (66, 70)])
def test_deepseek_prefill_decode(deepseek, seed, n_prefill, T):
    hf, ours, _ = deepseek.cases[seed]
    ids = deepseek.ids(T, seed)
    _check(_decode(ours, ids, n_prefill), H.reference_logits(hf, ids),
           f"deepseek decode {n_prefill}+{T - n_prefill} seed={seed}")


def test_deepseek_fp8_weights_dequantised_at_load(deepseek, root):
    """FP8 e4m3 weights with 16x16-block weight_scale_inv kept by `--dtype keep`, dequantised by the loader, against
    transformers running the same dequantised weights (dequantised here in torch)."""
    from ckpt_helpers import fp8_quantize_dir
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV32ForCausalLM

    _, _, hf_dir = deepseek.cases[0]
    q_dir = fp8_quantize_dir(hf_dir, root / "ds_fp8_hf", block=(16, 16))
    dq_dir = root / "ds_fp8_dequant_hf"
    dq_dir.mkdir()
    t = load_file(str(q_dir / "model.safetensors"))
    plain = {}
    for name, w in t.items():
        if name.endswith("_scale_inv"):
            continue
        s = t.get(name + "_scale_inv")
        if s is not None:
            s = s.repeat_interleave(16, 0).repeat_interleave(16, 1)[: w.shape[0], : w.shape[1]]
            w = w.float() * s
        plain[name] = w.contiguous()
    save_file(plain, str(dq_dir / "model.safetensors"), metadata={"format": "pt"})
    (dq_dir / "config.json").write_text((hf_dir / "config.json").read_text())
    hf = DeepseekV32ForCausalLM.from_pretrained(str(dq_dir), attn_implementation="eager").float().eval()
    convert(str(q_dir), str(root / "ds_fp8_jax"), dtype="keep", progress=False)
    ours = _same_jit(deepseek.base, kimi_jax.load_model(str(root / "ds_fp8_jax")))
    ids = deepseek.ids(70, 0)
    _check(ours.logits(ids), H.reference_logits(hf, ids), "deepseek fp8-kept logits")


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["plain_rope_ungrouped", "yarn_mscale_ne_all_dim", "yarn_mscale_only"])
def test_deepseek_rope_variants(root, variant):
    rope = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32)
    over = {
        "plain_rope_ungrouped": dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0), n_group=1,
                                     topk_group=1),
        # cos/sin scaled by m(f, 0.8) / m(f, 0.7), softmax by m(f, 0.7)^2, correction range not rounded
        "yarn_mscale_ne_all_dim": dict(rope_parameters=dict(rope, mscale=0.8, mscale_all_dim=0.7, truncate=False)),
        # transformers ignores a lone mscale: cos/sin scaled by m(f) = 1 + 0.1 ln f, softmax unscaled
        "yarn_mscale_only": dict(rope_parameters=dict(rope, mscale=0.5)),
    }[variant]
    fam = Family("ds", root, f"ds_{variant}", seeds=(4,), num_hidden_layers=2, **over)  # dense + MoE layer
    hf, ours, _ = fam.cases[4]
    ids = fam.ids(12, 4)
    _check(_decode(ours, ids, 5), H.reference_logits(hf, ids), f"deepseek {variant} prefill+decode")


def test_zz_report():
    """Prints the worst relative errors (visible with `pytest -s`)."""
    for case, rel in sorted(RESULTS.items()):
        print(f"  {rel:.2e}  {case}")
