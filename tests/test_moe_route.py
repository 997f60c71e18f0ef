"""The MoE's decode-sized glue as GPU kernels (`pallas_kernels.moe.gpu_route`, run here in Triton's interpreter):
the expert selection chooses what the XLA router chooses (docs/model.md §7) and the tile plan is the XLA plan
element for element; a MoE layer on the GPU backend routes through the kernel and gives the reference layer's
output."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("triton")

from kimi_jax.config import MoEConfig  # noqa: E402
from pallas_kernels.moe import gpu_route, routing  # noqa: E402
from pallas_kernels.moe.mgpu_mxfp4 import rows as tile_rows  # noqa: E402

# (experts, top-k, groups, top groups, bias in weights, scaling): Kimi-Linear, DeepSeek-V3.2, K3.1, a small one
ROUTERS = {
    "kimi-linear": (256, 8, 1, 1, False, 2.446),
    "deepseek-groups": (256, 8, 8, 4, False, 2.5),
    "k3.1": (896, 16, 1, 1, False, 1.0),
    "small-bias-in-weights": (16, 4, 4, 2, True, 1.0),
}


def _cfg(name, renormalize=True):
    E, k, G, TG, biased, scale = ROUTERS[name]
    return MoEConfig(num_experts=E, top_k=k, intermediate_size=64, num_groups=G, topk_groups=TG,
                     bias_in_weights=biased, routed_scaling_factor=scale, renormalize=renormalize)


@pytest.mark.parametrize("name", sorted(ROUTERS))
@pytest.mark.parametrize("tokens", [1, 7, 32])
def test_the_selection_kernel_chooses_the_routers_experts(name, tokens):
    """Same experts in the same order (largest biased score first); the weights equal up to the order of the
    renormalising sum."""
    cfg = _cfg(name, renormalize=tokens != 7)
    rng = np.random.default_rng(tokens)
    logits = jnp.asarray(rng.standard_normal((tokens, cfg.num_experts)) * 2, jnp.float32)
    bias = jnp.asarray(rng.standard_normal(cfg.num_experts) / 10, jnp.float32)
    w, idx = gpu_route.select_experts(logits, bias, cfg, interpret=True)
    w_ref, idx_ref = routing.select_experts(logits, bias, cfg)
    assert idx.dtype == jnp.int32 and w.dtype == jnp.float32 and idx.shape == w.shape == (tokens, cfg.top_k)
    np.testing.assert_array_equal(idx, idx_ref)
    np.testing.assert_allclose(w, w_ref, rtol=1e-6, atol=1e-7)


def test_ties_go_to_the_lower_expert_id_as_top_k():
    """Equal scores are taken in expert-id order, as `jax.lax.top_k` takes them: whole rows of one value, pairs of
    equal experts, equal group scores, and a row whose every score but two is -inf-like after the group cut."""
    cfg = MoEConfig(num_experts=16, top_k=4, intermediate_size=8, num_groups=4, topk_groups=2)
    logits = np.zeros((4, 16), np.float32)
    logits[1, [3, 9, 12, 14]] = 1.0
    logits[2] = np.repeat([0.5, 0.2, 0.5, 0.1], 4)  # groups 0 and 2 tie
    logits[3, :8] = -30.0
    bias = jnp.zeros(16, jnp.float32)
    w, idx = gpu_route.select_experts(jnp.asarray(logits), bias, cfg, interpret=True)
    w_ref, idx_ref = routing.select_experts(jnp.asarray(logits), bias, cfg)
    np.testing.assert_array_equal(idx, idx_ref)
    np.testing.assert_allclose(w, w_ref, rtol=1e-6)
    np.testing.assert_array_equal(idx[0], [0, 1, 2, 3])


@pytest.mark.parametrize("tokens, k, experts, rows", [(1, 8, 256, 16), (32, 8, 256, 16), (5, 16, 896, 8),
                                                      (7, 4, 6, 4), (12, 3, 3, 8), (32, 2, 1, 16)])
def test_the_plan_kernel_is_the_xla_tile_plan(tokens, k, experts, rows):
    """`gpu_route.slot_tile_plan` = `rows.slot_tile_plan` element for element: the source pair of every padded row
    (none: N·k), each tile's expert, the live tiles and each pair's padded row — with experts repeated inside a
    token, experts left empty and every pair on one expert."""
    rng = np.random.default_rng(tokens + k)
    if experts >= k and tokens % 2:  # distinct experts per token, as the router gives
        idx = np.stack([rng.permutation(experts)[:k] for _ in range(tokens)])
    else:
        idx = rng.integers(0, experts, (tokens, k))
    idx = jnp.asarray(idx, jnp.int32)
    plan = gpu_route.slot_tile_plan(idx, experts, rows, interpret=True)
    want = tile_rows.slot_tile_plan(idx, experts, rows)
    for field, got, ref in zip(want._fields, plan, want):
        assert got.shape == ref.shape and got.dtype == ref.dtype, field
        np.testing.assert_array_equal(got, ref, err_msg=field)


def test_batches_past_one_program_are_refused():
    """The kernels hold a batch in one program; the callers take the XLA forms past `takes`."""
    assert gpu_route.takes(32, 1024) and gpu_route.takes(1, 896)
    assert not gpu_route.takes(33, 1024) and not gpu_route.takes(129, 256) and not gpu_route.takes(0, 8)
    cfg = _cfg("kimi-linear")
    with pytest.raises(ValueError, match="exceed one program"):
        gpu_route.select_experts(jnp.zeros((256, 256)), jnp.zeros(256), cfg, interpret=True)
    with pytest.raises(ValueError, match="exceed one program"):
        gpu_route.slot_tile_plan(jnp.zeros((256, 8), jnp.int32), 256, 16, interpret=True)


def test_a_moe_layer_on_the_gpu_backend_routes_through_the_kernel(monkeypatch):
    """A MoE layer run with the GPU MoE kernels (interpreted) selects its experts with `gpu_route.select_experts` at
    decode sizes and gives the reference layer's output; a prefill-sized batch keeps the XLA router."""
    from flax import nnx

    from kimi_jax.modules.moe import MoE
    from pallas_kernels.moe.activations import situ
    from sharding.context import ForwardContext, KernelConfig

    cfg = MoEConfig(num_experts=16, top_k=4, intermediate_size=32, num_shared_experts=1, num_groups=4,
                    topk_groups=2, routed_scaling_factor=2.5)
    layer = MoE(64, cfg, situ, 1e-6, rngs=nnx.Rngs(0))
    calls = []
    kernel = gpu_route.select_experts
    monkeypatch.setattr(gpu_route, "select_experts", lambda *a, **kw: calls.append(a[0].shape) or kernel(*a, **kw))
    x = jax.random.normal(jax.random.key(1), (2, 3, 64), jnp.float32)
    gpu = ForwardContext(kernels=KernelConfig(moe="gpu", moe_interpret=True))
    ref = ForwardContext(kernels=KernelConfig(moe="reference"))
    np.testing.assert_allclose(layer(x, gpu), layer(x, ref), rtol=2e-5, atol=2e-5)
    assert calls == [(6, 16)]
    layer(jnp.zeros((1, 4096, 64)), gpu)  # 4,096 tokens x 16 experts: past one program
    assert calls == [(6, 16)]
