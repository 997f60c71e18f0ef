"""Mesh parsing (AxB and the named form with the expert overlay), partition rules, and: every GSPMD layout (TP,
TP+EP, EP over context x tensor) gives the logits and greedy tokens of one device (8 fake CPU devices, in a
subprocess so the flag does not leak into other tests). Token-split prefill and DCP decode:
tests/test_context_parallel.py."""

import subprocess
import sys
import textwrap

import jax
import pytest
from jax.sharding import PartitionSpec as P

from sharding import MeshError, make_mesh, param_partition_spec, parse_mesh_spec
from server_process import cpu_devices_env


def test_mesh_spec_forms():
    assert parse_mesh_spec("8x1") == {"data": 1, "context": 1, "model": 8, "expert": 8}
    assert parse_mesh_spec("model=4,data=2") == {"data": 2, "context": 1, "model": 4, "expert": 4}
    # the vLLM-style layout: attention token-split over 8 devices, experts 8-way over the same devices
    assert parse_mesh_spec("expert=8,tensor=1,context=8") == {"data": 1, "context": 8, "model": 1, "expert": 8}
    assert parse_mesh_spec("tensor=2, context=4") == {"data": 1, "context": 4, "model": 2, "expert": 2}
    for bad in ("8", "0x1", "axb", "model=2,pipe=2", "tensor=2,model=2", "context=0"):
        with pytest.raises(MeshError):
            parse_mesh_spec(bad)
    with pytest.raises(MeshError, match=r"expert=4 must equal tensor \(2.*context x tensor"):
        parse_mesh_spec("expert=4,tensor=2,context=4")


def test_named_mesh_axes_and_expert_overlay():
    from sharding import expert_axes

    m = make_mesh("context=1")
    assert m.axis_names == ("data", "context", "model") and m.devices.size == 1
    assert expert_axes(make_mesh("1x1")) == ("model",)
    assert expert_axes(make_mesh("expert=1,tensor=1,context=1")) == ("model",)
    with pytest.raises(MeshError, match="unknown mesh axes"):
        make_mesh({"pipeline": 2})


def test_too_few_devices_says_how_to_fake_them():
    n = len(jax.devices()) + 1
    with pytest.raises(MeshError, match=f"xla_force_host_platform_device_count={n}"):
        make_mesh(f"{n}x1")


def test_rules_split_heads_experts_and_vocab():
    assert param_partition_spec("layers.1.self_attn.q_proj.kernel", (64, 96 * 128), 8) == P(None, "model")
    assert param_partition_spec("layers.1.self_attn.o_proj.kernel", (96 * 128, 64), 8) == P("model", None)
    assert param_partition_spec("layers.3.self_attn.k_up_proj", (512, 96, 128), 8) == P(None, "model", None)
    assert param_partition_spec("layers.3.block_sparse_moe.experts.gate", (896, 3584, 3072), 8) == P("model", None, None)
    assert param_partition_spec("embed_tokens", (163840, 7168), 8) == P("model", None)
    assert param_partition_spec("layers.3.self_attn.indexer.wq_b.kernel", (1536, 4096), 8) == P()
    assert param_partition_spec("layers.3.self_attn.kv_a_proj_with_mqa.kernel", (7168, 576), 8) == P()
    # a dimension the axis does not divide stays replicated instead of failing
    assert param_partition_spec("layers.1.self_attn.A_log", (2,), 8) == P()
    # KDA heads: convs, gates, A_log / dt_bias; MLA: q_b, the output gate; the dense FFN's intermediate width
    assert param_partition_spec("layers.1.self_attn.k_conv1d", (4, 96 * 128), 8) == P(None, "model")
    assert param_partition_spec("layers.1.self_attn.dt_bias", (96 * 128,), 8) == P("model")
    assert param_partition_spec("layers.1.self_attn.b_proj.kernel", (7168, 96), 8) == P(None, "model")
    assert param_partition_spec("layers.3.self_attn.q_b_proj.kernel", (1536, 96 * 192), 8) == P(None, "model")
    assert param_partition_spec("layers.0.mlp.down_proj.kernel", (33792, 7168), 8) == P("model", None)
    assert param_partition_spec("lm_head.kernel", (7168, 163840), 8) == P(None, "model")
    assert param_partition_spec("layers.3.input_layernorm.weight", (7168,), 8) == P()


def test_rules_experts_over_the_expert_axes():
    """`expert=8,tensor=1,context=8`: experts split 8-way over (context, model) while heads stay whole."""
    ax = (("context", 8), ("model", 1))
    assert param_partition_spec("layers.3.block_sparse_moe.experts.down", (896, 3072, 3584), 1, expert_axes=ax) == \
        P("context", None, None)
    ax = (("context", 4), ("model", 2))
    assert param_partition_spec("layers.3.block_sparse_moe.experts.gate", (896, 3584, 3072), 2, expert_axes=ax) == \
        P(("context", "model"), None, None)
    assert param_partition_spec("layers.3.self_attn.q_b_proj.kernel", (1536, 96 * 192), 2, expert_axes=ax) == \
        P(None, "model")
    # 6 experts do not split 8 ways: replicated
    assert param_partition_spec("layers.3.block_sparse_moe.experts.gate", (6, 8, 8), 2, expert_axes=ax) == P()


SCRIPT = textwrap.dedent("""
    import jax, numpy as np, kimi_jax
    ids = np.random.RandomState(0).randint(0, 1000, (2, 20))
    ref = kimi_jax.load_model("tiny")
    r, g = ref.logits(ids), ref.generate(ids[:, :6], 3)
    explicit = jax.make_mesh((4, 2), ("model", "data"))  # jax.make_mesh's default axes are Explicit
    for mesh in ("2x4", "8x1", "expert=8,tensor=1,context=8", explicit):
        m = kimi_jax.load_model("tiny", mesh=mesh)
        mesh = mesh if isinstance(mesh, str) else "make_mesh"
        assert len(m.params["embed_tokens"][...].sharding.device_set) == 8
        # experts split over "model" or overlaid on ("context", "model"): every MoE layer runs expert-parallel (a
        # kernel's custom call would be gathered whole by GSPMD); the overlay in detail: tests/test_expert_overlay.py
        from sharding.moe import expert_ways
        assert expert_ways(m.ctx, m.config.moe.num_experts) > 1, mesh
        l = m.logits(ids)
        err = float(np.abs(l - r).max() / r.std())
        assert err < 1e-4 and (l.argmax(-1) == r.argmax(-1)).all(), (mesh, err)
        if mesh == "2x4":
            assert (m.generate(ids[:, :6], 3) == g).all(), mesh
        print(mesh, "ok", err)
""")


@pytest.mark.slow
def test_sharded_layouts_match_one_device():
    env = cpu_devices_env(8)
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "2x4 ok" in out.stdout and "8x1 ok" in out.stdout and "context=8 ok" in out.stdout
    assert "make_mesh ok" in out.stdout


KIMI_LINEAR_DP_SCRIPT = textwrap.dedent("""
    import sys, numpy as np, kimi_jax
    ids = np.random.RandomState(0).randint(0, 250, (2, 6))
    ref = kimi_jax.load_model(sys.argv[1]).logits(ids)
    got = kimi_jax.load_model(sys.argv[1], mesh="1x8").logits(ids)
    print("1x8 err", float(np.abs(got - ref).max() / np.abs(ref).max()))
""")


@pytest.mark.slow
def test_kimi_linear_on_eight_data_parallel_cpu_devices(tmp_path):
    """A Kimi-Linear checkpoint on a 1x8 mesh of fake CPU devices gives the one-device logits. It used to hang: the
    KDA reference's batched LAPACK triangular solve waited on the thread pool that ran all 8 device programs."""
    import hf_fixtures as H

    # 4 KDA heads: B·H = 8 solves per call, enough for jaxlib to spread them over the pool (2 heads never hung)
    H.make_kimi_linear(str(tmp_path / "kl"), seed=0, num_attention_heads=4, num_key_value_heads=4,
                       linear_attn_config={"num_heads": 4})
    env = cpu_devices_env(8)
    out = subprocess.run([sys.executable, "-c", KIMI_LINEAR_DP_SCRIPT, str(tmp_path / "kl")], env=env,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert float(out.stdout.split("1x8 err")[1]) < 1e-5, out.stdout


CKPT_EXPERT_SCRIPT = textwrap.dedent("""
    from jax.sharding import PartitionSpec as P
    from kimi_jax.checkpoint import _sharding
    from sharding import make_mesh
    for text, axes in (("expert=8,tensor=1,context=8", "context"), ("expert=8,tensor=2,context=4", ("context", "model")),
                       ("8x1", "model")):
        mesh = make_mesh(text)
        for name in ("layers.3.block_sparse_moe.experts.gate", "layers.3.block_sparse_moe.experts.down.packed"):
            assert _sharding(name, (16, 32, 32), mesh).spec == P(axes, None, None), (text, name)
        assert _sharding("lm_head.kernel", (64, 1024), mesh).spec == (P() if "tensor=1" in text else P(None, "model"))
    print("ok")
""")


def test_checkpoint_places_experts_over_the_expert_axes_directly():
    """Loading a checkpoint places each routed-expert array on the mesh's expert axes as it is read. With experts
    over ("context", "model") (`expert=8,tensor=1,context=8`) the loader used the "model"-only rule, so every
    device first received every expert (a full replica of the expert weights per device) before `Model` re-split
    them."""
    env = cpu_devices_env(8)
    out = subprocess.run([sys.executable, "-c", CKPT_EXPERT_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


IMAGES_ON_A_MESH_SCRIPT = textwrap.dedent("""
    import numpy as np, kimi_jax
    img = (np.random.RandomState(0).rand(60, 90, 3) * 255).astype(np.uint8)  # 3 x 4 merged tokens after padding
    want = kimi_jax.load_model("tiny").encode_images([img])[0]
    for mesh in ("8x1", "2x4"):
        got = kimi_jax.load_model("tiny", mesh=mesh).encode_images([img])[0]
        err = float(np.abs(got.astype(np.float32) - want.astype(np.float32)).max())
        print(mesh, "ok" if got.shape == want.shape == (12, 64) and err < 1e-5 else f"FAILED {got.shape} {err}")
""")


def test_image_features_on_a_mesh_equal_one_device():
    """`serve --mesh 8x1` with images: the vision tower's bucketed program runs on the model's mesh (parameters
    placed there, host-made taps, angles and merge indices alongside) and gives one device's features."""
    env = cpu_devices_env(8)
    out = subprocess.run([sys.executable, "-c", IMAGES_ON_A_MESH_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "8x1 ok" in out.stdout and "2x4 ok" in out.stdout, out.stdout
