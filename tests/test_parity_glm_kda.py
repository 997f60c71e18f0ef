"""The K3 KDA gate form against code nobody here wrote: transformers 5.23's GLM-5.3-Flash (`glm5_next`) KDA layer.

SPEC §1 lists the lower-bound ("safe") gate, g = lower_bound · sigmoid(exp(A_log[h]) · (f + dt_bias)), as shared by
K3 and GLM; Kimi-Linear (the full-model parity in test_parity_hf.py) has the plain gate. So one GLM KDA layer with
random weights — its own pure-torch chunked KDA, low-rank output gate, sigmoid-gated RMSNorm — is the public check
of our lower-bound gate path: `KimiDeltaAttention` with the same weights, as a chunked prefill over 70 tokens (two
chunks of 64) and as 70 one-token decode steps, against GLM's prefill in float32.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
glm = pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from kimi_jax.config import KDAConfig  # noqa: E402
from kimi_jax.modules.kda import KDACache, KimiDeltaAttention  # noqa: E402

H, d, D, K = 2, 16, 64, 4  # heads, head width, hidden width, conv taps
B, T = 2, 70  # two KDA chunks of 64


def _rel_max(ours, ref) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="module")
def layers():
    """(GLM's layer, ours) with the same random weights; the GLM gate parameters drawn so the gate spans its range."""
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

    cfg = Glm5NextTextConfig(hidden_size=D, linear_num_heads=H, linear_head_dim=d, linear_conv_kernel_dim=K,
                             linear_lower_bound=-5.0, num_hidden_layers=2,
                             layer_types=["linear_attention", "indexed_attention"])
    torch.manual_seed(0)
    ref = glm.Glm5NextTextLinearAttention(cfg, 0).float()
    with torch.no_grad():
        for _, p in ref.named_parameters():
            p.copy_(torch.randn_like(p) * (p.shape[-1] ** -0.5 if p.ndim > 1 else 0.5))
        ref.forget_gate.A_log.copy_(torch.log(torch.empty(H).uniform_(1, 16)))
        ref.forget_gate.dt_bias.copy_(torch.randn(H * d) * 0.5 - 1.0)
        ref.o_norm.weight.copy_(1 + 0.1 * torch.randn(d))

    ours = KimiDeltaAttention(D, KDAConfig(num_heads=H, head_dim=d, conv_kernel=K, gate_form="lower_bound",
                                           gate_lower_bound=-5.0, output_gate_rank=d), rngs=nnx.Rngs(0))
    P = H * d

    def t(p):
        return jnp.asarray(p.detach().numpy())

    for name in ("q_proj", "k_proj", "v_proj", "b_proj", "g_a_proj", "g_b_proj", "o_proj"):
        getattr(ours, name).kernel[...] = t(getattr(ref, name).weight).T  # torch [out, in] -> ours [in, out]
    ours.f_a_proj.kernel[...] = t(ref.forget_gate.f_a_proj.weight).T
    ours.f_b_proj.kernel[...] = t(ref.forget_gate.f_b_proj.weight).T
    conv = t(ref.conv1d.weight)[:, 0, :]  # one depthwise conv over [q | k | v]: [3P, K], tap K−1 = current token
    ours.q_conv1d[...], ours.k_conv1d[...], ours.v_conv1d[...] = conv[:P].T, conv[P:2 * P].T, conv[2 * P:].T
    ours.A_log[...] = t(ref.forget_gate.A_log)
    ours.dt_bias[...] = t(ref.forget_gate.dt_bias)
    ours.o_norm[...] = t(ref.o_norm.weight)
    return ref, ours


@pytest.fixture(scope="module")
def case(layers):
    ref, _ = layers
    x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(x).numpy()
    g = ref.forget_gate(x).detach().numpy()
    return x.numpy(), want, g


def test_the_case_exercises_the_lower_bound_gate(case):
    """The drawn gates span [lower_bound, 0], saturating at both ends in float32: strong and weak decay both occur."""
    _, _, g = case
    assert (g >= -5.0).all() and (g <= 0).all()
    assert (g < -4.0).mean() > 0.05 and (g > -0.5).mean() > 0.05


def test_glm_kda_layer_prefill(layers, case):
    _, ours = layers
    x, want, _ = case
    got, _ = ours(jnp.asarray(x))
    assert _rel_max(np.asarray(got), want) < 1e-4


def test_glm_kda_layer_step_decode(layers, case):
    """One token at a time through our recurrent path and cache (conv tails, state) equals GLM's chunked prefill."""
    _, ours = layers
    x, want, _ = case
    step = nnx.jit(lambda layer, x_b1d, cache: layer(x_b1d, cache, use_chunk=False))
    cache, outs = KDACache.zeros(B, ours.cfg, jnp.float32), []
    for i in range(T):
        out, cache = step(ours, jnp.asarray(x[:, i:i + 1]), cache)
        outs.append(np.asarray(out))
    assert _rel_max(np.concatenate(outs, axis=1), want) < 1e-4
