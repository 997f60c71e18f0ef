"""Configs, presets, Hugging Face config parsing and the capacity planner (SPEC §2, §10; DESIGN.md plan interface)."""

import json
import subprocess
import sys

import pytest

from kimi_jax import config as C
from kimi_jax.cache import CacheLayout, index_key_bytes_per_token, latent_bytes_per_token
from kimi_jax.plan import count_params, plan


def k3_hf_config(with_dsa=True):
    """A kimi_k3 config.json as released: text part under text_config, 1-indexed layer lists."""
    n = 93
    full = [i + 1 for i, kind in enumerate(C.k3_layer_kinds(n)) if kind == "mla"]
    text = {
        "model_type": "kimi_linear", "hidden_size": 7168, "vocab_size": 163840, "num_hidden_layers": n,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 1048576, "tie_word_embeddings": False,
        "linear_attn_config": {"num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4,
                               "gate_lower_bound": -5.0, "use_full_rank_gate": True,
                               "kda_layers": [i for i in range(1, n + 1) if i not in full],
                               "full_attn_layers": full},
        "num_attention_heads": 96, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True, "mla_use_output_gate": True,
        "attn_res_block_size": 12, "intermediate_size": 33792, "first_k_dense_replace": 1,
        "num_experts": 896, "num_experts_per_token": 16, "num_shared_experts": 2, "moe_intermediate_size": 3072,
        "routed_expert_hidden_size": 3584, "latent_moe_use_norm": True, "moe_router_activation_func": "sigmoid",
        "num_expert_group": 1, "topk_group": 1, "moe_renormalize": True, "routed_scaling_factor": 1.0,
        "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
        "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839,
    }
    top = {"model_type": "kimi_k3", "text_config": text, "vision_config": {"patch_size": 14}}
    if with_dsa:
        text["dsa_config"] = {"index_n_heads": 32, "index_head_dim": 128, "index_topk": 2048,
                              "index_layers": full}
    return top


def test_k3_layer_pattern_is_24_mla_including_the_last():
    kinds = C.k3_layer_kinds(93)
    mla = [i for i, k in enumerate(kinds) if k == "mla"]
    assert len(mla) == 24 and mla[:3] == [3, 7, 11] and mla[-2:] == [91, 92]
    assert kinds.count("kda") == 69


def test_hf_k31_config_parses_to_the_preset():
    parsed = C.from_hf_config(k3_hf_config())
    preset = C.get_preset("kimi-k3.1-pro")
    assert parsed.layer_kinds == preset.layer_kinds
    assert parsed.indexer == preset.indexer
    assert parsed.kda == preset.kda and parsed.moe == preset.moe
    assert parsed.attn_res_block_size == 12 and parsed.activation == "situ"
    assert parsed.architecture == "kimi_k31"
    assert C.from_hf_config(k3_hf_config(with_dsa=False)).architecture == "kimi_k3"


def test_hf_keys_that_transformers_ignores_are_ignored_here_too():
    """Kimi: tie_word_embeddings (KimiLinearForCausalLM declares no tied weights and keeps its lm_head.weight);
    DeepSeek-V3.2: rope_interleave (DeepseekV32Config drops it: RoPE is always interleaved)."""
    kimi = dict(k3_hf_config(), tie_word_embeddings=True)
    assert C.from_hf_config(kimi).tie_embeddings is False
    ds = C.from_hf_config({"model_type": "deepseek_v32", "num_hidden_layers": 2, "hidden_size": 64,
                           "intermediate_size": 128, "moe_intermediate_size": 32, "vocab_size": 256,
                           "num_attention_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 32,
                           "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
                           "n_routed_experts": 4, "num_experts_per_tok": 2, "rope_interleave": False,
                           "index_n_heads": 2, "index_head_dim": 16, "index_topk": 8})
    assert ds.mla.rope.interleaved is True
    with pytest.raises(C.ConfigError, match="attention_bias"):  # a refusal naming the key, not a tensor list
        C.from_hf_config({"model_type": "deepseek_v32", "attention_bias": True})


def test_config_round_trips_through_json():
    for name in C.PRESETS:
        cfg = C.get_preset(name)
        assert C.ModelConfig.from_dict(json.loads(cfg.to_json())) == cfg


def test_unknown_architecture_and_bad_layer_lists_are_clear_errors():
    with pytest.raises(C.ConfigError, match="unknown architecture.*llama"):
        C.from_hf_config({"model_type": "llama"})
    bad = k3_hf_config()
    bad["text_config"]["linear_attn_config"]["full_attn_layers"].append(94)
    with pytest.raises(C.ConfigError, match="1-indexed"):
        C.from_hf_config(bad)
    with pytest.raises(C.ConfigError, match="unknown preset"):
        C.get_preset("kimi-k9")
    softmax = k3_hf_config()
    softmax["text_config"]["moe_router_activation_func"] = "softmax"
    with pytest.raises(C.ConfigError, match="unsupported router: moe_router_activation_func='softmax'"):
        C.from_hf_config(softmax)
    # a per-layer list that disagrees with num_hidden_layers (transformers' Kimi-Linear config writes layer_types)
    for key, kinds in (("layer_types", ["linear_attention"] * 3 + ["full_attention"]), ("mlp_layer_types", ["dense"])):
        short = k3_hf_config()
        short["text_config"][key] = kinds
        with pytest.raises(C.ConfigError, match=f"{key} lists {len(kinds)} layers but num_hidden_layers is 93"):
            C.from_hf_config(short)


def test_impossible_sizes_are_clear_errors():
    """Zero heads would fail deep inside the model build; more experts per token than experts would convert and fail
    at the first forward: both are refused when the config is read."""
    for key, value, match in (("num_attention_heads", 0, "attention heads = 0"), ("kv_lora_rank", 0, "kv_lora_rank = 0"),
                              ("hidden_size", -1, "hidden_size = -1"),
                              ("num_experts_per_token", 900, r"experts per token \(900\) .* experts \(896\)")):
        hf = k3_hf_config()
        hf["text_config"][key] = value
        with pytest.raises(C.ConfigError, match=match):
            C.from_hf_config(hf)
    hf = k3_hf_config()
    hf["text_config"]["linear_attn_config"]["num_heads"] = 0
    with pytest.raises(C.ConfigError, match="KDA heads = 0"):
        C.from_hf_config(hf)


def test_missing_keys_and_bad_json_are_clear_errors_naming_the_file(tmp_path):
    """A config.json without a required key, or not JSON at all: a ConfigError naming the file (and the key);
    the planner exits 2 with it, no traceback."""
    hf = k3_hf_config()
    del hf["text_config"]["moe_intermediate_size"]
    with pytest.raises(C.ConfigError, match="lacks the required key 'moe_intermediate_size'"):
        C.from_hf_config(hf)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(C.ConfigError, match="config.json: .*moe_intermediate_size"):
        C.load_config(str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "kimi_jax.plan", "--config", str(tmp_path)], capture_output=True,
                         text=True)
    assert out.returncode == 2 and "moe_intermediate_size" in out.stderr and "Traceback" not in out.stderr
    (tmp_path / "config.json").write_text('{"model_type": "kimi_k3",')
    with pytest.raises(C.ConfigError, match="config.json: cannot read it as JSON"):
        C.load_config(str(tmp_path))


def test_param_counts_of_k31_pro_from_abstract_shapes():
    counts = count_params(C.get_preset("kimi-k3.1-pro"))
    assert abs(counts["params_total"] / 2.8e12 - 1) <= 0.02
    assert abs(counts["params_active"] / 104e9 - 1) <= 0.03
    # routed experts alone: 896 x 92 x 3 x 3584 x 3072
    assert counts["routed_params"] == 896 * 92 * 3 * 3584 * 3072


def test_cache_bytes_match_spec_section_10():
    assert latent_bytes_per_token(512, 64, "bf16") == 1152
    assert latent_bytes_per_token(512, 64, "fp8") == 576
    assert latent_bytes_per_token(512, 64, "nvfp4") == 352
    assert index_key_bytes_per_token(128, "fp8") == 132
    assert index_key_bytes_per_token(128, "mxfp4") == 68
    k3, k31 = C.get_preset("kimi-k3"), C.get_preset("kimi-k3.1-pro")
    assert CacheLayout(k3, kv_dtype="fp8").kv_bytes_per_token == 13_824
    assert CacheLayout(k31, kv_dtype="fp8", index_dtype="fp8").kv_bytes_per_token == 16_992
    assert CacheLayout(k31, kv_dtype="nvfp4", index_dtype="mxfp4").kv_bytes_per_token == 10_080
    # KDA recurrent state: 96 x 128 x 128 fp32 = 6 MiB per layer, 69 layers
    assert CacheLayout(k31).kda_state_bytes_per_layer >= 6 * 2**20
    assert 414 * 2**20 <= CacheLayout(k31).state_bytes_per_sequence < 440 * 2**20


def test_dcp_holds_more_tokens_than_tp():
    cfg = C.get_preset("kimi-k3.1-pro")
    tp = plan(cfg, mesh=(8, 1), hbm_gb=288)
    dcp = plan(cfg, mesh=(8, 1), dcp=8, hbm_gb=288, kv_dtype="nvfp4", index_dtype="mxfp4")
    assert tp["fits"] and dcp["fits"]
    assert dcp["max_cached_tokens"] > 8 * tp["max_cached_tokens"]
    assert dcp["max_1m_sequences"] > 5 * tp["max_1m_sequences"] >= 5


def test_plan_reproduces_the_published_1m_token_capacities():
    """SPEC §10: 3 concurrent 1M-token contexts on 8 × GB300 (288 GB) with TP8 + FP8, about 36 with DCP8 +
    NVFP4 / MXFP4 (MXFP4 routed experts, the KDA state counted per sequence)."""
    cfg = C.get_preset("kimi-k3.1-pro")
    assert plan(cfg, mesh=(8, 1), hbm_gb=288)["max_1m_sequences"] == 3
    dcp = plan(cfg, mesh=(8, 1), dcp=8, hbm_gb=288, kv_dtype="nvfp4", index_dtype="mxfp4")["max_1m_sequences"]
    assert 33 <= dcp <= 39


def test_plan_cli_json_keys():
    out = subprocess.run([sys.executable, "-m", "kimi_jax.plan", "--config", "kimi-k3.1-pro", "--mesh", "8x1",
                          "--hbm-gb", "288", "--dcp", "8", "--json"], capture_output=True, text=True, check=True)
    r = json.loads(out.stdout)
    for key in ("params_total", "params_active", "kv_bytes_per_token", "state_bytes_per_sequence",
                "max_cached_tokens", "max_1m_sequences"):
        assert key in r
    assert r["kv_bytes_per_token"] == 16_992
    bad = subprocess.run([sys.executable, "-m", "kimi_jax.plan", "--config", "nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and "neither a preset" in bad.stderr


@pytest.mark.parametrize("kw,match", [(dict(dcp=0), "at least 1"), (dict(dcp=3, mesh=(8, 1)), "divide"),
                                      (dict(hbm_gb=0), "positive"), (dict(hbm_gb=-5), "positive"),
                                      (dict(hbm_gb=float("inf")), "finite"), (dict(hbm_gb=1e300), "finite"),
                                      (dict(hbm_gb=float("nan")), "finite"),
                                      (dict(gpu_memory_utilization=1.5), r"\(0, 1\]")])
def test_plan_refuses_meaningless_capacity_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        plan(C.get_preset("kimi-k3.1-pro"), **kw)


def test_full_size_presets_build_abstractly_under_eval_shape():
    """DESIGN.md: the full-size presets are usable abstractly with jax.eval_shape — load_model's size guard only
    stops materialising them (2.8T parameters, shapes only, no memory, a few seconds: the rng draws stay eager)."""
    import time

    import jax

    import kimi_jax
    from kimi_jax.model import param_count

    start = time.monotonic()
    shapes = jax.eval_shape(lambda: kimi_jax.load_model("kimi-k3.1-pro").params)
    assert time.monotonic() - start < 120  # was 3.5-7 min: every traced rng draw rescanned the whole trace
    leaves = jax.tree.leaves(shapes)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert sum(x.size for x in leaves) == param_count(C.get_preset("kimi-k3.1-pro"))
    with pytest.raises(ValueError, match="too large to materialise"):
        kimi_jax.load_model("kimi-k3.1-pro")


def test_release_weights_follow_each_familys_published_format():
    """--weights-dtype release: MXFP4 routed experts for K3.1, FP8 for DeepSeek-V3.2, bf16 for Kimi-Linear."""
    def weights(preset, dtype):
        return plan(C.get_preset(preset), weights_dtype=dtype)["weight_bytes"]

    assert weights("deepseek-v3.2", "release") == weights("deepseek-v3.2", "fp8")
    assert weights("kimi-linear-48b", "release") == weights("kimi-linear-48b", "bf16")
    assert weights("kimi-k3.1-pro", "release") < weights("kimi-k3.1-pro", "fp8")


def test_plan_gives_the_k31_pro_cache_figures_of_issue_5_over_24_mla_layers():
    """SPEC §10 / issue 5 item 6: over the 24 MLA layers of K3.1 Pro the planner gives 13,824 B/token of FP8 latent
    (K3's whole cache), 16,992 with FP8 index keys and 10,080 with an NVFP4 latent and MXFP4 keys; K3 (no DSA
    indexer) caches no index key. The capacities follow from those bytes: each device holds hbm × utilisation minus
    its share of the weights; a token costs its bytes on every device under TP and 1/dcp of them under DCP; a 1M-token
    (2^20) sequence costs 2^20 tokens plus the fixed KDA state."""
    k31, k3 = C.get_preset("kimi-k3.1-pro"), C.get_preset("kimi-k3")
    fp8 = plan(k31, mesh=(8, 1), hbm_gb=288)
    assert (fp8["latent_bytes_per_token"], fp8["index_bytes_per_token"], fp8["kv_bytes_per_token"]) == \
        (13_824, 24 * 132, 16_992)
    nv = plan(k31, mesh=(8, 1), hbm_gb=288, dcp=8, kv_dtype="nvfp4", index_dtype="mxfp4")
    assert (nv["latent_bytes_per_token"], nv["index_bytes_per_token"], nv["kv_bytes_per_token"]) == \
        (24 * 352, 24 * 68, 10_080)
    only = plan(k3, mesh=(8, 1), hbm_gb=288)
    assert only["kv_bytes_per_token"] == only["latent_bytes_per_token"] == 13_824
    assert only["index_bytes_per_token"] == 0 and only["index_dtype"] is None
    for r in (fp8, nv, only):
        per_token = r["kv_bytes_per_token"] / r["dcp"]
        cache = 288e9 * 0.9 - r["weight_bytes"] / 8
        assert r["cache_bytes_per_device"] == int(cache)
        assert r["max_cached_tokens"] == int(cache // per_token)
        assert r["max_1m_sequences"] == int(cache // (2**20 * per_token + r["state_bytes_per_sequence"]))
    out = subprocess.run([sys.executable, "-m", "kimi_jax.plan", "--config", "kimi-k3.1-pro", "--mesh", "8x1",
                          "--hbm-gb", "288"], capture_output=True, text=True, check=True).stdout
    assert "16,992 B over 24 MLA layers = latent 13,824 B" in out and "index key 3,168 B" in out
    assert "TP8 (latent replicated on every device)" in out and "3 concurrent 1M-token sequences" in out
