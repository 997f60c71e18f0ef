"""Conversion, export and loading of checkpoints (`python -m convert`, `kimi_jax.checkpoint.load`).

Sources: tiny Kimi-Linear / DeepSeek-V3.2 models saved by transformers (tests/hf_fixtures.py), an FP8 block-quantised
copy of the DeepSeek one, and synthetic K3.1-layout checkpoints (language_model. prefix, padded A_log, MXFP4 experts,
vision tensors; convert/synthetic.py). No model forward is compiled here (see test_parity_hf.py for logits).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import kimi_jax
from ckpt_helpers import assert_same_tensors, fp8_quantize_dir, leftovers, read_all, rewrite_dir
from convert import ConvertError, export
from convert.__main__ import main as cli_main
from convert.synthetic import write_k3_checkpoint
from kimi_jax.checkpoint import convert_checkpoint as convert
from kimi_jax.config import get_preset

H = pytest.importorskip("hf_fixtures")
pytest.importorskip("transformers")


def _k3_cfg():
    """The tiny K3.1 preset (its latent width, 64, is a multiple of the MXFP4 group of 32)."""
    cfg = get_preset("tiny")
    assert cfg.moe.latent_size % 32 == 0
    return cfg


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("convert")


@pytest.fixture(scope="module")
def kl_dir(work):
    H.make_kimi_linear(str(work / "kl_hf"), seed=0)
    return work / "kl_hf"


@pytest.fixture(scope="module")
def ds_dir(work):
    H.make_deepseek_v32(str(work / "ds_hf"), seed=0)
    return work / "ds_hf"


@pytest.fixture(scope="module")
def ds_fp8_dir(ds_dir, work):
    return fp8_quantize_dir(ds_dir, work / "ds_fp8_hf", block=(16, 16))


@pytest.fixture(scope="module")
def k3_dir(work):
    write_k3_checkpoint(str(work / "k3_hf"), _k3_cfg(), seed=1, dtype="F32", shard_bytes=200_000)
    return work / "k3_hf"


@pytest.fixture(scope="module")
def k3_bf16_dir(work):
    write_k3_checkpoint(str(work / "k3_bf16_hf"), _k3_cfg(), seed=2, dtype="BF16", shard_bytes=150_000)
    return work / "k3_bf16_hf"


# ------------------------------------------------------------------------------------------------- round trips

@pytest.mark.parametrize("which", ["kl", "k3_mxfp4_f32", "k3_mxfp4_bf16", "ds_fp8_kept"])
def test_roundtrip_bit_identical(which, request, work):
    """SRC -> convert --dtype keep -> export -> OUT: same names, dtypes, shapes and bytes as SRC."""
    src = request.getfixturevalue({"kl": "kl_dir", "k3_mxfp4_f32": "k3_dir", "k3_mxfp4_bf16": "k3_bf16_dir",
                                   "ds_fp8_kept": "ds_fp8_dir"}[which])
    dst, out = work / f"rt_{which}_jax", work / f"rt_{which}_out"
    convert(str(src), str(dst), dtype="keep", progress=False, part_bytes=100_000)
    meta = json.load(open(dst / "kimi_jax_checkpoint.json"))
    assert len(meta["parts"]) > 1  # several Orbax parts
    s = export(str(dst), str(out), shard_bytes=120_000, progress=False)
    assert s["shards"] > 1
    n = assert_same_tensors(src, out)
    index = json.load(open(out / "model.safetensors.index.json"))
    assert len(index["weight_map"]) == n and set(index["weight_map"].values()) == {
        f for f in os.listdir(out) if f.endswith(".safetensors")}
    assert json.load(open(out / "config.json")) == json.load(open(src / "config.json"))
    assert leftovers(work) == []
    if which.startswith("k3"):
        w1 = next(e for e in meta["entries"] if e["kind"] == "experts")
        assert set(w1["extra"]["arrays"]) == {"layers.1.block_sparse_moe.experts.gate_packed",
                                              "layers.1.block_sparse_moe.experts.gate_scale"}
        assert any(e["src"].startswith("vision_tower.") for e in meta["entries"] if e["kind"] == "extra")
        assert (dst / "tokenizer_config.json").exists() and (out / "tokenizer_config.json").exists()
    if which == "ds_fp8_kept":
        assert any(n.endswith("kv_b_proj_fp8") for e in meta["entries"] for n in e["extra"]["arrays"])


def test_kimi_linear_release_dense_mlp_names(kl_dir, tmp_path):
    """Released Kimi-Linear checkpoints name the dense layer `mlp.*`; transformers saves `block_sparse_moe.*`. Both
    load to the same parameters, and export restores the spelling of the source."""
    def rename(t):
        return {k.replace("layers.0.block_sparse_moe.", "layers.0.mlp."): v for k, v in t.items()}

    src = rewrite_dir(kl_dir, tmp_path / "src", rename)
    assert "model.layers.0.mlp.gate_proj.weight" in read_all(src)
    convert(str(src), str(tmp_path / "dst"), dtype="keep", progress=False)
    export(str(tmp_path / "dst"), str(tmp_path / "out"), progress=False)
    assert_same_tensors(src, tmp_path / "out")
    a, b = _flat_params(kimi_jax.load_model(str(src))), _flat_params(kimi_jax.load_model(str(kl_dir)))
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_deepseek_mtp_layer_carried_through(ds_dir, tmp_path):
    """The release's multi-token-prediction layer (model.layers.<num_hidden_layers>.*) is not part of the model:
    kept untouched under extra/ and exported again."""
    mtp = {"model.layers.3.eh_proj.weight": np.arange(12, dtype=np.float32).reshape(3, 4),
           "model.layers.3.enorm.weight": np.ones(4, np.float32)}
    src = rewrite_dir(ds_dir, tmp_path / "src", lambda t: {**t, **mtp})
    convert(str(src), str(tmp_path / "dst"), dtype="keep", progress=False)
    meta = json.load(open(tmp_path / "dst" / "kimi_jax_checkpoint.json"))
    assert sorted(e["src"] for e in meta["entries"] if e["kind"] == "extra") == sorted(mtp)
    export(str(tmp_path / "dst"), str(tmp_path / "out"), progress=False)
    assert_same_tensors(src, tmp_path / "out")


def test_converted_layout(k3_dir, work):
    """Every parameter of a converted K3.1 checkpoint against an independent transcription of the layouts."""
    dst = work / "layout_k3_jax"
    convert(str(k3_dir), str(dst), dtype="keep", progress=False)
    cfg = kimi_jax.load_config(str(dst))
    assert cfg == _k3_cfg().replace(vision=cfg.vision) and cfg.vision is not None
    model = kimi_jax.load_model(str(dst))
    got = _flat_params(model)
    want = _expected_k3(read_all(k3_dir), cfg)
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        assert got[name].shape == w.shape, name
        np.testing.assert_array_equal(got[name], w.astype(np.float32), err_msg=name)
    # on the fly from the HF dir: identical parameters
    direct = _flat_params(kimi_jax.load_model(str(k3_dir)))
    for name in want:
        np.testing.assert_array_equal(direct[name], got[name], err_msg=name)


def _flat_params(model) -> dict:
    import jax

    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(model.params)[0]:
        parts = (str(getattr(p, "key", getattr(p, "idx", getattr(p, "name", "")))) for p in path)
        out[".".join(x for x in parts if x and x != "value")] = np.asarray(leaf, np.float32)
    return out


def _e2m1(code):
    """e2m1 by definition: sign bit, 2 exponent bits (bias 1, subnormal at 0), 1 mantissa bit."""
    s, e, m = code >> 3, (code >> 1) & 3, code & 1
    mag = np.where(e == 0, 0.5 * m, 2.0 ** (e.astype(np.float64) - 1) * (1 + 0.5 * m))
    return np.where(s == 1, -mag, mag)


def _mxfp4(packed, scale):
    codes = np.stack([packed & 15, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
    return _e2m1(codes) * np.repeat(2.0 ** (scale.astype(np.float64) - 127), 32, axis=-1)


def _expected_k3(hf: dict, cfg) -> dict:
    """HF K3 tensors -> kimi_jax parameters, written out by hand from SPEC §4-8 (independent of convert/)."""
    P, want = "language_model.model.", {}
    H, d = cfg.kda.num_heads, cfg.kda.head_dim
    m = cfg.mla
    n_, v_ = m.qk_nope_head_dim, m.v_head_dim
    for name, w in hf.items():
        if name.startswith(("vision_tower.", "mm_projector.")):
            continue
        if name == "language_model.lm_head.weight":
            want["lm_head.kernel"] = w.T
            continue
        t = name[len(P):]
        if t.endswith("_res_proj.weight"):  # [1, D] -> [D]
            want[t.replace("_res_proj.weight", "_res.proj_weight")] = w[0]
        elif t.endswith("_res_norm.weight"):
            want[t.replace("_res_norm.weight", "_res.norm_weight")] = w
        elif t == "embed_tokens.weight":
            want["embed_tokens"] = w
        elif t.endswith("A_log"):
            assert w.shape == (cfg.kda.a_log_checkpoint_size,) and not w[H:].any()
            want[t] = w[:H]
        elif t.endswith("dt_bias"):
            want[t] = w
        elif t.endswith("_conv1d.weight"):  # [P, 1, K] -> [K, P]
            want[t[: -len(".weight")]] = w[:, 0, :].T
        elif t.endswith("o_norm.weight"):
            want[t[: -len(".weight")]] = w
        elif t.endswith("kv_b_proj.weight"):
            base = t[: -len("kv_b_proj.weight")]
            R = w.shape[1]
            k_up, v_up = np.zeros((R, m.num_heads, n_)), np.zeros((R, m.num_heads, v_))
            for h in range(m.num_heads):
                rows = w[h * (n_ + v_):(h + 1) * (n_ + v_)]
                k_up[:, h, :], v_up[:, h, :] = rows[:n_].T, rows[n_:].T
            want[base + "k_up_proj"], want[base + "v_up_proj"] = k_up, v_up
        elif ".experts." in t:  # MXFP4 experts load packed, stacked in the HF [E, out, in/2] / [E, out, in/32] layout
            pre, rest = t.split(".experts.")
            e, which, kind = rest.split(".")
            field = {"w1": "gate", "w3": "up", "w2": "down"}[which] + {"weight_packed": ".packed",
                                                                     "weight_scale": ".scale"}[kind]
            want.setdefault(pre + ".experts." + field, {})[int(e)] = w
        elif t.endswith("block_sparse_moe.gate.weight"):
            want[t[: -len(".weight")]] = w.T
        elif t.endswith("e_score_correction_bias"):
            want[t.replace("gate.e_score_correction_bias", "e_score_correction_bias")] = w
        elif w.ndim == 2:
            want[t[: -len(".weight")] + ".kernel"] = w.T
        else:  # RMSNorm / LayerNorm weights and biases keep their names
            want[t] = w
    for k, v in list(want.items()):
        if isinstance(v, dict):
            want[k] = np.stack([v[e] for e in range(len(v))])
    return want


def test_hf_dir_loads_without_temp_files(kl_dir, work, tmp_path, monkeypatch):
    """Loading a HF dir converts in memory: identical parameters to the converted checkpoint, nothing written."""
    import tempfile

    scratch = tmp_path / "tmpdir"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    before = sorted(os.listdir(kl_dir))
    direct = _flat_params(kimi_jax.load_model(str(kl_dir)))
    assert sorted(os.listdir(kl_dir)) == before and os.listdir(scratch) == []
    monkeypatch.undo()
    dst = tmp_path / "kl_jax"
    convert(str(kl_dir), str(dst), dtype="keep", progress=False)
    conv = _flat_params(kimi_jax.load_model(str(dst)))
    assert sorted(direct) == sorted(conv)
    for k in direct:
        np.testing.assert_array_equal(direct[k], conv[k], err_msg=k)
    # dtype override: bfloat16 model, float32 where the model keeps float32
    m16 = kimi_jax.load_model(str(dst), dtype="bfloat16")
    leaves = {k: v.dtype for k, v in _named(m16).items()}
    assert str(leaves["layers.0.self_attn.q_proj.kernel"]) == "bfloat16"
    assert str(leaves["layers.0.self_attn.A_log"]) == "float32"
    assert str(leaves["layers.1.block_sparse_moe.gate"]) == "float32"


def test_a_load_builds_the_model_once(kl_dir, work, monkeypatch):
    """The loader asks the model for its shapes and fills that same abstract model: one `KimiForCausalLM` per load,
    from a Hugging Face directory and from a converted checkpoint (convert itself never builds one)."""
    from kimi_jax.modules.decoder import KimiForCausalLM

    dst = work / "kl_built_once_jax"
    convert(str(kl_dir), str(dst), dtype="keep", progress=False)
    built, init = [], KimiForCausalLM.__init__

    def counted(self, *a, **kw):
        built.append(1)
        init(self, *a, **kw)

    monkeypatch.setattr(KimiForCausalLM, "__init__", counted)
    for path in (kl_dir, dst):
        built.clear()
        kimi_jax.load_model(str(path))
        assert len(built) == 1, path


def _named(model) -> dict:
    import jax

    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(model.params)[0]:
        parts = (str(getattr(p, "key", getattr(p, "idx", getattr(p, "name", "")))) for p in path)
        out[".".join(x for x in parts if x and x != "value")] = leaf
    return out


def test_dtype_bf16_dequantises_fp8(ds_fp8_dir, work):
    """--dtype bf16: FP8 block weights dequantised (w * scale per 16x16 block) then bfloat16; parameters the model
    keeps in float32 stay float32; export writes bf16 tensors and drops quantization_config."""
    import ml_dtypes

    dst, out = work / "ds_bf16_jax", work / "ds_bf16_out"
    assert cli_main([str(ds_fp8_dir), str(dst), "--dtype", "bf16", "--quiet"]) == 0
    meta = json.load(open(dst / "kimi_jax_checkpoint.json"))
    assert meta["dtype_policy"] == "bf16" and meta["param_dtype"] == "bfloat16"
    hf = read_all(ds_fp8_dir)
    q, s = hf["model.layers.1.self_attn.q_b_proj.weight"], hf["model.layers.1.self_attn.q_b_proj.weight_scale_inv"]
    deq = q.astype(np.float32) * np.repeat(np.repeat(s, 16, 0), 16, 1)[: q.shape[0], : q.shape[1]]
    m = kimi_jax.load_model(str(dst))
    p = _named(m)
    np.testing.assert_array_equal(np.asarray(p["layers.1.self_attn.q_b_proj.kernel"]),
                                  deq.T.astype(ml_dtypes.bfloat16))
    assert str(p["layers.1.block_sparse_moe.e_score_correction_bias"].dtype) == "float32"
    assert export(str(dst), str(out), progress=False)["shards"] == 1
    back = read_all(out)
    assert "model.layers.1.self_attn.q_b_proj.weight_scale_inv" not in back
    assert back["model.layers.1.self_attn.q_b_proj.weight"].dtype == ml_dtypes.bfloat16
    assert "quantization_config" not in json.load(open(out / "config.json"))


def test_dtype_fp8_requantises(kl_dir, work):
    """--dtype fp8: projection and expert weights stored as FP8 e4m3 + 128x128 scales; loads close to the original;
    exports as weight + weight_scale_inv with a quantization_config."""
    dst, out = work / "kl_fp8_jax", work / "kl_fp8_out"
    convert(str(kl_dir), str(dst), dtype="fp8", progress=False)
    meta = json.load(open(dst / "kimi_jax_checkpoint.json"))
    arrays = {n for e in meta["entries"] for n in e["extra"]["arrays"]}
    assert {"layers.0.self_attn.q_proj.kernel_fp8", "layers.0.self_attn.q_proj.kernel_scale_inv",
            "layers.1.block_sparse_moe.experts.gate_fp8", "layers.2.self_attn.kv_b_proj_fp8"} <= arrays
    assert "embed_tokens" in arrays and "lm_head.kernel" in arrays  # not quantised
    orig, got = _flat_params(kimi_jax.load_model(str(kl_dir))), _flat_params(kimi_jax.load_model(str(dst)))
    for k in ("layers.0.self_attn.q_proj.kernel", "layers.1.block_sparse_moe.experts.down",
              "layers.2.self_attn.k_up_proj"):
        rel = np.linalg.norm(got[k] - orig[k]) / np.linalg.norm(orig[k])
        assert 0 < rel < 0.05, (k, rel)
    export(str(dst), str(out), progress=False)
    back = read_all(out)
    assert str(back["model.layers.0.self_attn.q_proj.weight"].dtype) == "float8_e4m3fn"
    assert back["model.layers.0.self_attn.q_proj.weight_scale_inv"].shape == (1, 1)
    assert json.load(open(out / "config.json"))["quantization_config"]["quant_method"] == "fp8"


def test_mxfp4_decoder_matches_definition():
    """The codec's host MXFP4 forms (what convert reads and writes checkpoints with) against the definition."""
    from pallas_kernels.codec import mxfp4_dequantize_np as mxfp4_dequant, mxfp4_quantize_np as mxfp4_quant

    rng = np.random.default_rng(0)
    packed = rng.integers(0, 256, (3, 16), dtype=np.uint8)
    scale = rng.integers(100, 140, (3, 1), dtype=np.uint8)
    np.testing.assert_array_equal(mxfp4_dequant(packed, scale), _mxfp4(packed, scale).astype(np.float32))
    # low nibble = even element: byte 0x21 -> [code 1, code 2] = [0.5, 1.0] * 2^(127-127)
    assert mxfp4_dequant(np.full((1, 16), 0x21, np.uint8), np.full((1, 1), 127, np.uint8))[0, :2].tolist() == [0.5, 1.0]
    w = rng.standard_normal((4, 64)).astype(np.float32)
    p, s = mxfp4_quant(w)
    assert np.allclose(mxfp4_dequant(p, s), w, atol=0.25 * np.abs(w).max())


# ------------------------------------------------------------------------------------------------- bad input

def _expect_error(src, dst, *parts, **kw):
    with pytest.raises(ConvertError) as ei:
        convert(str(src), str(dst), progress=False, **kw)
    msg = str(ei.value)
    for p in parts:
        assert p in msg, msg
    assert not os.path.exists(dst)
    assert leftovers(os.path.dirname(dst)) == []
    return msg


def test_unknown_architecture(kl_dir, tmp_path):
    src = rewrite_dir(kl_dir, tmp_path / "src", config=lambda hf: hf.update(model_type="llama"))
    _expect_error(src, tmp_path / "dst", "unknown architecture", "llama")
    _expect_error(kl_dir, tmp_path / "dst2", "--architecture deepseek_v32 does not match", "kimi_linear",
                  architecture="deepseek_v32")
    _expect_error(kl_dir, tmp_path / "dst3", "unknown architecture 'gpt'", architecture="gpt")


def test_malformed_config(kl_dir, tmp_path):
    """A config.json that is JSON but not the expected objects is a ConvertError naming it, not a traceback."""
    src = rewrite_dir(kl_dir, tmp_path / "src", config=lambda hf: [1, 2])
    _expect_error(src, tmp_path / "dst", "config.json must hold a JSON object", "list")
    src2 = rewrite_dir(kl_dir, tmp_path / "src2", config=lambda hf: hf.update(linear_attn_config="x"))
    _expect_error(src2, tmp_path / "dst2", "config.json", "malformed kimi_linear config")


def test_missing_tensor(kl_dir, tmp_path):
    name = "model.layers.2.self_attn.kv_b_proj.weight"
    src = rewrite_dir(kl_dir, tmp_path / "src", lambda t: {k: v for k, v in t.items() if k != name})
    _expect_error(src, tmp_path / "dst", "missing tensor", name)


def test_unexpected_tensors_listed(kl_dir, tmp_path):
    extra = {"model.layers.0.self_attn.rogue.weight": np.zeros(3, np.float32), "foo.bar": np.ones(2, np.float32)}
    src = rewrite_dir(kl_dir, tmp_path / "src", lambda t: {**t, **extra})
    _expect_error(src, tmp_path / "dst", "unexpected tensor", *extra)


def test_shape_mismatch(kl_dir, tmp_path):
    name = "model.layers.1.self_attn.q_proj.weight"
    src = rewrite_dir(kl_dir, tmp_path / "src", lambda t: {**t, name: t[name][:30]})
    _expect_error(src, tmp_path / "dst", f"shape mismatch for {name}", "expected [32, 64]", "found [30, 64]")
    a_log = "model.layers.0.self_attn.A_log"  # a shape nobody documented is refused, not guessed
    src2 = rewrite_dir(kl_dir, tmp_path / "src2", lambda t: {**t, a_log: np.zeros((4,), np.float32)})
    _expect_error(src2, tmp_path / "dst2", f"shape mismatch for {a_log}", "found [4]")


def test_dtype_mismatch(kl_dir, tmp_path):
    name = "model.layers.3.self_attn.o_proj.weight"
    src = rewrite_dir(kl_dir, tmp_path / "src", lambda t: {**t, name: t[name].astype(np.int32)})
    _expect_error(src, tmp_path / "dst", f"dtype mismatch for {name}", "found I32")


def test_fp8_weight_without_its_scale(ds_fp8_dir, tmp_path):
    name = "model.layers.0.mlp.down_proj.weight"
    src = rewrite_dir(ds_fp8_dir, tmp_path / "src", lambda t: {k: v for k, v in t.items() if k != name + "_scale_inv"})
    _expect_error(src, tmp_path / "dst", f"dtype mismatch for {name}", "found F8_E4M3",
                  f"needs its {name}_scale_inv, which is missing")


def test_bad_fp8_block_size(ds_fp8_dir, tmp_path):
    for i, block in enumerate(([128], [0, 0], "x")):
        src = rewrite_dir(ds_fp8_dir, tmp_path / f"src{i}",
                          config=lambda hf: hf["quantization_config"].update(weight_block_size=block))
        _expect_error(src, tmp_path / f"dst{i}", "config.json: quantization_config.weight_block_size must be two "
                      "positive integers", repr(block))


def test_experts_must_share_one_dtype(k3_dir, tmp_path):
    """Experts are stacked into one array: an E8M0 scale among uint8 ones would be cast by value (127 -> 134)."""
    import ml_dtypes

    name = "language_model.model.layers.1.block_sparse_moe.experts.2.w1.weight_scale"
    src = rewrite_dir(k3_dir, tmp_path / "src", lambda t: {**t, name: t[name].view(ml_dtypes.float8_e8m0fnu)})
    _expect_error(src, tmp_path / "dst", f"dtype mismatch for {name}", "expected U8 like expert 0", "F8_E8M0")


def test_a_log_padding_must_be_zero(k3_dir, tmp_path):
    name = "language_model.model.layers.0.self_attn.A_log"

    def tf(t):
        a = t[name].copy()
        a[-1] = 0.5
        return {**t, name: a}

    src = rewrite_dir(k3_dir, tmp_path / "src", tf)
    _expect_error(src, tmp_path / "dst", name, "not zero")


@pytest.mark.parametrize("damage", ["truncated", "garbage_header", "short"])
def test_corrupt_safetensors(kl_dir, tmp_path, damage):
    src = tmp_path / "src"
    shutil.copytree(kl_dir, src)
    path = src / "model.safetensors"
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[: len(data) - 1000])
    elif damage == "garbage_header":
        path.write_bytes(data[:8] + b"{nonsense" + data[17:])
    else:
        path.write_bytes(data[:5])
    _expect_error(src, tmp_path / "dst", "truncated or corrupt safetensors file", str(path))


def test_index_naming_missing_shard(k3_dir, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(k3_dir, src)
    victim = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))[1]
    os.remove(src / victim)
    _expect_error(src, tmp_path / "dst", "shard file(s) that do not exist", victim)
    index = src / "model.safetensors.index.json"
    for weight_map in ([victim], {"embed.weight": None}):
        index.write_text(json.dumps({"weight_map": weight_map}))
        _expect_error(src, tmp_path / "dst", str(index), "weight_map must map tensor names to shard file names")


def test_destination_exists_and_overwrite(kl_dir, tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    with pytest.raises(ConvertError, match="already exists; pass --overwrite"):
        convert(str(kl_dir), str(dst), progress=False)
    assert (dst / "keep.txt").read_text() == "mine"
    with pytest.raises(ConvertError, match="overlaps the source"):
        convert(str(kl_dir), str(kl_dir), overwrite=True, progress=False)
    convert(str(kl_dir), str(dst), overwrite=True, dtype="keep", progress=False)
    assert not (dst / "keep.txt").exists() and (dst / "kimi_jax_checkpoint.json").exists()
    assert leftovers(tmp_path) == []
    # the finished checkpoint has a plain directory's mode (not a temp dir's private 0700)
    umask = os.umask(0o022)
    os.umask(umask)
    assert (dst.stat().st_mode & 0o777) == 0o777 & ~umask
    (tmp_path / "out").mkdir()
    with pytest.raises(ConvertError, match="already exists"):
        export(str(dst), str(tmp_path / "out"), progress=False)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConvertError, match="cannot create destination .*afile is not a directory"):
        convert(str(kl_dir), str(tmp_path / "afile" / "sub" / "dst"), progress=False)


def test_failure_midway_leaves_nothing(kl_dir, tmp_path, monkeypatch):
    """An error after some parts were written: no destination, no temp dir; an existing destination survives."""
    import convert.importer as imp

    real, calls = imp.build, [0]

    def flaky(*a, **k):
        calls[0] += 1
        if calls[0] == 40:
            raise OSError("disk on fire")
        return real(*a, **k)

    monkeypatch.setattr(imp, "build", flaky)
    dst = tmp_path / "dst"
    with pytest.raises(OSError, match="disk on fire"):
        convert(str(kl_dir), str(dst), part_bytes=20_000, progress=False)
    assert not dst.exists() and leftovers(tmp_path) == []
    dst.mkdir()
    (dst / "old.txt").write_text("old")
    calls[0] = 0
    with pytest.raises(OSError):
        convert(str(kl_dir), str(dst), overwrite=True, part_bytes=20_000, progress=False)
    assert (dst / "old.txt").read_text() == "old" and leftovers(tmp_path) == []


def test_load_reports_damaged_checkpoint(kl_dir, tmp_path):
    dst = tmp_path / "kl_jax"
    convert(str(kl_dir), str(dst), part_bytes=50_000, progress=False)
    shutil.rmtree(dst / "params" / "part_00001")
    with pytest.raises(ConvertError, match="part_00001"):
        kimi_jax.load_model(str(dst))
    with pytest.raises(ConvertError, match="not a converted kimi_jax checkpoint"):
        export(str(kl_dir), str(tmp_path / "out"), progress=False)
    meta_path = dst / "kimi_jax_checkpoint.json"
    meta = json.loads(meta_path.read_text())
    for damaged, says in (([], "must hold a JSON object"), ({**meta, "entries": None}, "'entries' list is missing"),
                          ({**meta, "parts": meta["parts"][:1]}, "lists 1 part(s)")):
        meta_path.write_text(json.dumps(damaged))
        with pytest.raises(ConvertError, match=re.escape(says)):
            kimi_jax.load_model(str(dst))
    # without its metadata file the directory still has config.json: it must not be read as a Hugging Face one
    (dst / "kimi_jax_checkpoint.json").unlink()
    with pytest.raises(ConvertError, match="kimi_jax_checkpoint.json is missing"):
        kimi_jax.load_model(str(dst))


def test_bf16_policy_on_a_bf16_source_round_trips(k3_bf16_dir, work):
    """--dtype bf16 keeps some parameters in float32 (A_log, norms, router…); export gives them back in the source's
    dtype, so a bf16 source comes back bit for bit."""
    dst, out = work / "rt_bf16_policy_jax", work / "rt_bf16_policy_out"
    convert(str(k3_bf16_dir), str(dst), dtype="bf16", progress=False)
    meta = json.load(open(dst / "kimi_jax_checkpoint.json"))
    assert any(a[0] == "F32" for e in meta["entries"] for a in e["extra"]["arrays"].values())  # stored wider
    export(str(dst), str(out), progress=False)
    assert_same_tensors(k3_bf16_dir, out)


def test_bf16_export_keeps_the_source_dtypes_and_says_so_in_config(kl_dir, work):
    """--dtype bf16 on a float32 source: the export gives every plain tensor back in float32 (bf16-rounded values),
    and its config.json keeps the source's dtype rather than claiming bfloat16."""
    dst, out = work / "kl_bf16_jax", work / "kl_bf16_out"
    convert(str(kl_dir), str(dst), dtype="bf16", progress=False)
    export(str(dst), str(out), progress=False)
    src_t, out_t = read_all(kl_dir), read_all(out)
    assert sorted(src_t) == sorted(out_t)
    assert all(out_t[n].dtype == src_t[n].dtype for n in src_t)
    src_cfg, out_cfg = (json.load(open(d / "config.json")) for d in (kl_dir, out))
    for key in ("torch_dtype", "dtype"):
        assert out_cfg.get(key) == src_cfg.get(key)


def test_cli_logs_loads_by_relative_path_and_cleans_up_on_sigterm(kl_dir, tmp_path, monkeypatch):
    r = subprocess.run([sys.executable, "-m", "convert", str(kl_dir), str(tmp_path / "a")], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "wrote " in r.stderr and "kimi_linear" in r.stderr  # the progress lines, not only the bar
    proc = subprocess.Popen([sys.executable, "-m", "convert", str(kl_dir), str(tmp_path / "b"), "--part-size",
                             "20KB"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not any(n.startswith(".b.tmp-") for n in os.listdir(tmp_path)) and proc.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143 and "nothing was written" in err, err[-3000:]
    assert sorted(os.listdir(tmp_path)) == ["a"]  # no temporary directory left, no b
    monkeypatch.chdir(tmp_path)
    assert kimi_jax.load_model("a").config.architecture == "kimi_linear"  # a relative path (Orbax wants absolute)


def test_a_sigterm_while_the_temporary_directory_is_made_leaves_nothing(kl_dir, tmp_path, monkeypatch):
    """The CLI's SIGTERM handler fired while the temporary directory and its owner file are made (the window the
    SIGTERM test above once hit): the handler only records it there, the conversion stops at its first check with
    the same exception, and neither the directory nor the output is left."""
    import signal

    import convert.store as store
    from convert import interrupt
    from convert.__main__ import _interrupt, _Terminated

    fresh = store._owned_fresh_dir

    def fresh_then_sigterm(prefix):
        made = fresh(prefix)
        _interrupt(signal.SIGTERM, None)  # as the signal would arrive here
        return made

    monkeypatch.setattr(store, "_owned_fresh_dir", fresh_then_sigterm)
    with pytest.raises(_Terminated):
        convert(str(kl_dir), str(tmp_path / "a"), progress=False)
    assert os.listdir(tmp_path) == []
    interrupt.check()  # raised once, then clear


def test_an_interrupt_whose_exception_was_swallowed_still_stops_the_conversion(kl_dir, tmp_path):
    """Ctrl-C's exception can land in a callback whose exceptions Python ignores (JAX's GC hook), and the
    conversion would run on. The CLI's handler also records it (`convert.interrupt`): the next tensor, or at the
    latest the final commit, raises it, and nothing is written."""
    from convert import interrupt

    for job in (lambda: convert(str(kl_dir), str(tmp_path / "a"), progress=False),
                lambda: export(str(tmp_path / "ok"), str(tmp_path / "b"), progress=False)):
        if not (tmp_path / "ok").exists():
            convert(str(kl_dir), str(tmp_path / "ok"), progress=False)
        interrupt.request(KeyboardInterrupt)  # as the handler does, after its own raise went nowhere
        with pytest.raises(KeyboardInterrupt):
            job()
    assert sorted(os.listdir(tmp_path)) == ["ok"]  # no a, no b, no temporary directory
    interrupt.check()  # raised once, then clear


def test_cli_reports_file_system_and_damaged_part_errors_without_tracebacks(kl_dir, tmp_path, capsys, monkeypatch):
    """A refusal of the file system (disk full) is one "error:" line, exit 2, nothing left; so is a damaged part, and
    Orbax's late "Event loop is closed" callbacks after its failed read print nothing."""
    import convert.importer as imp

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(imp, "build", full)
        assert cli_main([str(kl_dir), str(tmp_path / "a"), "--quiet"]) == 2
    assert "No space left on device; nothing was written" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []
    convert(str(kl_dir), str(tmp_path / "a"), part_bytes=50_000, progress=False)
    part = tmp_path / "a" / "params" / "part_00001"
    data = max((p for p in part.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    os.truncate(data, 100)
    r = subprocess.run([sys.executable, "-m", "convert", "--export", str(tmp_path / "a"), str(tmp_path / "b"),
                        "--quiet"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "cannot read checkpoint part" in r.stderr and "part_00001" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert sorted(os.listdir(tmp_path)) == ["a"]


def test_cli(kl_dir, tmp_path, capsys):
    """The command line with its defaults: conversion keeps every tensor (DESIGN: the round trip must be lossless),
    so convert + --export gives the source tensors back bit for bit."""
    assert cli_main([str(kl_dir), str(tmp_path / "a"), "--quiet"]) == 0
    assert json.load(open(tmp_path / "a" / "kimi_jax_checkpoint.json"))["dtype_policy"] == "keep"
    assert cli_main([str(kl_dir), str(tmp_path / "a"), "--dtype", "keep", "--quiet"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert cli_main([str(tmp_path / "a"), str(tmp_path / "c"), "--quiet"]) == 2  # the arguments the wrong way round
    assert "already a converted kimi_jax checkpoint; to write it back as safetensors use --export" in \
        capsys.readouterr().err
    assert cli_main(["--export", str(tmp_path / "a"), str(tmp_path / "b"), "--quiet", "--shard-size", "100KB"]) == 0
    assert_same_tensors(kl_dir, tmp_path / "b")
    # an option of the other mode is refused, not silently ignored (--export writes the source dtypes back)
    for args, says in ((["--export", "a", "x", "--dtype", "bf16"], "--dtype applies only without --export"),
                       (["a", "x", "--shard-size", "1GB"], "--shard-size applies only with --export")):
        with pytest.raises(SystemExit) as ei:
            cli_main([str(tmp_path / p) if p in ("a", "x") else p for p in args])
        assert ei.value.code == 2 and says in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    r = subprocess.run([sys.executable, "-m", "convert", "--help"], capture_output=True, text=True, timeout=60)
    # no --mesh option: the help says that parameters are placed on a mesh when loaded
    assert r.returncode == 0 and "no --mesh option" in r.stdout and "mesh=" in r.stdout
