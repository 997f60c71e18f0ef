"""The GPU KDA kernels (native Triton, `pallas_kernels.kda.gpu_triton`) against the reference recurrence.

CPU: Triton's interpreter (backend "gpu_interpret"; tests/conftest.py sets TRITON_INTERPRET=1) on the small
varlen geometry of tests/test_kda_kernels.py, at its bars: relative RMS < 1e-4 for fp32 inputs (IEEE products),
< 5e-3 for bf16 inputs, outputs and final states checked separately. `gpu`-marked tests run the kernels through
jax-triton on a device: `JAX_PLATFORMS=cuda python -m pytest tests/test_triton_kda.py -m gpu`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("triton")
pytest.importorskip("torch")

from test_kda_kernels import BARS, CU_MANY, f32, inputs, rel_rms  # noqa: E402

from pallas_kernels.kda import gpu_triton, ops, reference as R  # noqa: E402


def _gate_case(seed, H, dk):
    r = np.random.default_rng(seed)
    A_log = jnp.asarray(np.log(r.uniform(1, 16, H)), jnp.float32)
    dt_bias = jnp.asarray(r.standard_normal(H * dk), jnp.float32)
    return A_log, dt_bias


@pytest.mark.parametrize("g_lo,g_hi", [(-30.0, -5.0), (-4.0, -0.01)])
def test_triton_chunk_varlen_fp32(g_lo, g_hi):
    """Many short sequences (one empty), T = 150, initial states; strong decay (the exact diagonal loop) and K3-range
    decay (the one-matmul diagonal block)."""
    q, k, v, g, beta = inputs(10, 1, 150, 2, 32, 16, g_lo, g_hi, jnp.float32)
    N = len(CU_MANY) - 1
    s0 = jnp.asarray(np.random.default_rng(11).standard_normal((N, 2, 32, 16)), jnp.float32)
    o, sf = ops.chunk(q, k, v, g, beta, initial_state=s0, cu_seqlens=CU_MANY, backend="gpu_interpret")
    o_r, s_r = R.recurrent_varlen(q, k, v, g, beta, CU_MANY, s0)
    assert o.shape == o_r.shape and sf.shape == (N, 2, 32, 16)
    assert rel_rms(o, o_r) < BARS[jnp.float32] and rel_rms(sf, s_r) < BARS[jnp.float32]
    np.testing.assert_array_equal(sf[2], s0[2])  # the empty sequence keeps its initial state


@pytest.mark.parametrize("tuning", [{}, dict(fast_diag=False, fast_inverse=False, wu_cols=2, intra_mm="tf32"),
                                    dict(intra_mm="bf16_rows", state_bv=16)])
@pytest.mark.parametrize("g_lo,g_hi", [(-4.0, -0.01), (-30.0, -5.0)])
def test_triton_chunk_varlen_bf16_tunings(tuning, g_lo, g_hi):
    """bf16 inputs with the knobs the port keeps: bf16 / TF32 products, exact diagonal loop and substitution
    inverse, W/U in two column tiles, a narrower state tile."""
    q, k, v, g, beta = inputs(18, 1, 150, 2, 32, 32, g_lo, g_hi, jnp.bfloat16)
    N = len(CU_MANY) - 1
    s0 = jnp.asarray(np.random.default_rng(19).standard_normal((N, 2, 32, 32)), jnp.float32)
    o, sf = gpu_triton.chunk(q, k, v, g, beta, CU_MANY, s0, interpret=True, tuning=tuning)
    o_r, s_r = R.recurrent_varlen(*f32(q, k, v), g, beta, CU_MANY, s0)
    assert o.dtype == jnp.bfloat16
    assert rel_rms(o, o_r) < BARS[jnp.bfloat16] and rel_rms(sf, s_r) < BARS[jnp.bfloat16]


def test_triton_chunk_fused_lower_bound_gate_d128():
    """The K3 gate computed in A1 from raw f, A_log and dt_bias; d = 128, two sequences, no initial state."""
    H, d = 2, 128
    q, k, v, f, beta = inputs(22, 1, 100, H, d, d, -4.0, 4.0, jnp.bfloat16)
    A_log, dt_bias = _gate_case(23, H, d)
    cu = np.array([0, 37, 100])
    o, sf = ops.chunk(q, k, v, f, beta, cu_seqlens=cu, backend="gpu_interpret", A_log=A_log, dt_bias=dt_bias,
                      gate_form="lower_bound")
    g = R.gate(f, A_log, dt_bias.reshape(H, d), "lower_bound")
    o_r, s_r = R.recurrent_varlen(*f32(q, k, v), g, beta, cu)
    assert rel_rms(o, o_r) < BARS[jnp.bfloat16] and rel_rms(sf, s_r) < BARS[jnp.bfloat16]


def test_triton_chunk_batch_plain_gate_fp32():
    """Uniform batch (no cu_seqlens), T = 70, the Kimi-Linear softplus gate fused."""
    B, T, H, dk, dv = 2, 70, 2, 16, 32
    q, k, v, f, beta = inputs(12, B, T, H, dk, dv, -4.0, 4.0, jnp.float32)
    A_log, dt_bias = _gate_case(13, H, dk)
    o, sf = ops.chunk(q, k, v, f, beta, backend="gpu_interpret", A_log=A_log, dt_bias=dt_bias, gate_form="plain")
    g = R.gate(f, A_log, dt_bias.reshape(H, dk), "plain")
    o_r, s_r = R.recurrent(q, k, v, g, beta)
    assert o.shape == (B, T, H, dv)
    assert rel_rms(o, o_r) < BARS[jnp.float32] and rel_rms(sf, s_r) < BARS[jnp.float32]


def test_triton_chunk_rejects_unknown_tuning_keys():
    """`tuning=` overrides `TUNING`'s knobs only: a misspelt key, or a form of the Pallas kernels these replaced
    (split_o, rows_form, wu_form, intra_split), raises instead of being ignored."""
    q, k, v, g, beta = inputs(41, 1, 20, 1, 16, 16, -4.0, -0.01, jnp.float32)
    for tuning in (dict(split_o=True), dict(rows_form="full"), dict(wu_form="inverse"), dict(intra_split=False),
                   dict(state_bw=16)):
        with pytest.raises(ValueError, match="unknown KDA GPU tuning keys"):
            gpu_triton.chunk(q, k, v, g, beta, np.array([0, 20]), interpret=True, tuning=tuning)


@pytest.mark.parametrize("dtype,form,tuning", [(jnp.float32, "plain", {}), (jnp.bfloat16, "lower_bound", {}),
                                               (jnp.float32, "lower_bound", dict(dec_heads=2, dec_bv=32)),
                                               (jnp.float32, None, {})])
def test_triton_recurrent_slots(dtype, form, tuning):
    """Slot-addressed decode, T = 2 steps, in-kernel gate (or a given g), heads per program; rows of the pool that
    are not addressed stay as they were."""
    B, T, H, dk, dv, S = 3, 2, 2, 32, 64, 5
    q, k, v, f, beta = inputs(20, B, T, H, dk, dv, -6.0, 2.0, dtype)
    r = np.random.default_rng(21)
    pool = jnp.asarray(r.standard_normal((S, H, dk, dv)), jnp.float32)
    slots = jnp.array([4, 0, 2], jnp.int32)
    if form is None:
        f = g = jnp.minimum(f, 0.0)
        kw = {}
    else:
        A_log, dt_bias = _gate_case(22, H, dk)
        kw = dict(A_log=A_log, dt_bias=dt_bias, gate_form=form)
        g = R.gate(f, A_log, dt_bias.reshape(H, dk), form)
    o, new_pool = gpu_triton.recurrent(q, k, v, f, beta, pool, slots, interpret=True, tuning=tuning, **kw)
    o_r, pool_r = R.recurrent_slots(*f32(q, k, v), g, beta, pool, slots)
    assert o.dtype == dtype
    assert rel_rms(o, o_r) < BARS[dtype] and rel_rms(new_pool[slots], pool_r[slots]) < BARS[dtype]
    np.testing.assert_array_equal(new_pool[jnp.array([1, 3])], pool[jnp.array([1, 3])])


def test_triton_recurrent_through_ops():
    q, k, v, g, beta = inputs(30, 2, 1, 2, 16, 16, -1.0, 0.0, jnp.float32)
    state = jnp.asarray(np.random.default_rng(31).standard_normal((2, 2, 16, 16)), jnp.float32)
    o, s = ops.recurrent(q, k, v, g, beta, state, backend="gpu_interpret")
    o_r, s_r = R.recurrent(q, k, v, g, beta, state)
    assert rel_rms(o, o_r) < 1e-5 and rel_rms(s, s_r) < 1e-5


# ------------------------------------------------------------------------------------------------ device

def _np32(x):
    return np.asarray(jnp.asarray(x, jnp.float32))


def _decode_step_case(dtype, seed=0, B=3, H=4, d=32, K=4, S=6):
    """One decode token for slots [4, 0, 2] of 6: projections, conv weights, gate parameters and pools."""
    r = np.random.default_rng(seed)
    rand = lambda *shape: r.standard_normal(shape).astype(np.float32)  # noqa: E731
    P = H * d
    x_in = tuple(jnp.asarray(rand(B, P), dtype) for _ in range(3))
    proj = (jnp.asarray(rand(B, P)), jnp.asarray(rand(B, H)), jnp.asarray(rand(B, P)))  # f, β and gate logits
    conv = tuple(jnp.asarray(rand(K, P) / 2) for _ in range(3))
    A_log, dt_bias = _gate_case(seed, H, d)
    o_norm = jnp.asarray(1 + 0.1 * rand(d))
    pools = (jnp.asarray(rand(S, H, d, d) / 4), *(jnp.asarray(rand(S, K - 1, P), dtype) for _ in range(3)))
    return (x_in, *proj, conv, A_log, dt_bias, o_norm, pools, jnp.asarray([4, 0, 2][:B], jnp.int32))


@pytest.mark.parametrize("dtype,form,K", [(jnp.float32, "plain", 4), (jnp.float32, "lower_bound", 4),
                                          (jnp.bfloat16, "lower_bound", 4), (jnp.bfloat16, "plain", 2)])
def test_the_decode_step_kernel_is_the_layer_after_its_projections(dtype, form, K):
    """`gpu_triton.decode_step` (conv + SiLU over the slots' tails, L2 norms, the gate from raw f, one delta-rule
    step, the gated output norm; the slots' states and tails updated) = `reference.decode_step`: the same bf16
    outputs and tails, float32 to 1e-6; the other slots untouched."""
    args = _decode_step_case(dtype, K=K)
    kw = dict(gate_form=form, lower_bound=-5.0, o_norm_eps=1e-5)
    o, pools = gpu_triton.decode_step(*args, interpret=True, **kw)
    o_r, pools_r = R.decode_step(*args, **kw)
    assert o.dtype == dtype and o.shape == o_r.shape == (3, 128)
    np.testing.assert_allclose(_np32(o), _np32(o_r), rtol=1e-6, atol=1e-6)
    for got, want, before in zip(pools, pools_r, args[-2]):
        assert got.dtype == before.dtype and got.shape == before.shape
        np.testing.assert_allclose(_np32(got), _np32(want), rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(_np32(got)[[1, 3, 5]], _np32(before)[[1, 3, 5]])


def test_the_decode_step_composes_every_backends_recurrence():
    """`ops.decode_step` off the GPU kernel is the reference's steps around that backend's recurrence: the GPU
    kernel, the Triton recurrence under the composed steps and the reference agree."""
    args = _decode_step_case(jnp.float32, seed=3)
    kw = dict(gate_form="plain", o_norm_eps=1e-6)
    fused = ops.decode_step(*args, backend="gpu_interpret", **kw)
    composed = R.decode_step(*args, recurrent_fn=lambda q, k, v, g, b, pool, slots, scale: ops.recurrent(
        q, k, v, g, b, pool, scale, slot_ids=slots, backend="gpu_interpret"), **kw)
    ref = ops.decode_step(*args, backend="reference", **kw)
    for a, b in ((fused, ref), (composed, ref)):
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            np.testing.assert_allclose(_np32(x), _np32(y), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_triton_chunk_device(dtype):
    cu = np.array([0, 1, 100, 100, 333, 1000])
    q, k, v, g, beta = inputs(50, 1, 1000, 4, 128, 128, -20.0, -0.5, dtype)
    s0 = jnp.asarray(np.random.default_rng(51).standard_normal((5, 4, 128, 128)) * 0.1, jnp.float32)
    o, sf = jax.jit(lambda *a: ops.chunk(*a[:5], initial_state=a[5], cu_seqlens=cu, backend="gpu"))(
        q, k, v, g, beta, s0)
    o_r, s_r = R.recurrent_varlen(*f32(q, k, v), g, beta, cu, s0)
    assert rel_rms(o, o_r) < BARS[dtype] and rel_rms(sf, s_r) < BARS[dtype]


@pytest.mark.gpu
def test_gpu_triton_chunk_k3_shape_fused_gate():
    """K3 heads (96 × 128), bf16, T = 4096 in two sequences, the lower-bound gate fused, vs the fp32 reference."""
    H, d, T = 96, 128, 4096
    q, k, v, f, beta = inputs(54, 1, T, H, d, d, -4.0, 4.0, jnp.bfloat16)
    A_log, dt_bias = _gate_case(55, H, d)
    cu = np.array([0, 1500, T])
    o, sf = jax.jit(lambda *a: ops.chunk(*a, cu_seqlens=cu, backend="gpu", A_log=A_log, dt_bias=dt_bias,
                                         gate_form="lower_bound"))(q, k, v, f, beta)
    g = R.gate(f, A_log, dt_bias.reshape(H, d), "lower_bound")
    o_r, s_r = jax.jit(lambda *a: ops.chunk(*a, cu_seqlens=cu, backend="reference"))(*f32(q, k, v), g, beta)
    assert rel_rms(o, o_r) < BARS[jnp.bfloat16] and rel_rms(sf, s_r) < BARS[jnp.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_triton_recurrent_device(dtype):
    q, k, v, f, beta = inputs(52, 16, 1, 8, 128, 128, -6.0, 2.0, dtype)
    A_log, dt_bias = _gate_case(53, 8, 128)
    r = np.random.default_rng(53)
    pool = jnp.asarray(r.standard_normal((40, 8, 128, 128)), jnp.float32)
    slots = jnp.asarray(r.permutation(40)[:16], jnp.int32)
    step = jax.jit(lambda *a: ops.recurrent(*a[:6], slot_ids=a[6], backend="gpu", A_log=A_log, dt_bias=dt_bias,
                                            gate_form="lower_bound"))
    o, new = step(q, k, v, f, beta, pool, slots)
    g = R.gate(f, A_log, dt_bias.reshape(8, 128), "lower_bound")
    o_r, pool_r = R.recurrent_slots(*f32(q, k, v), g, beta, pool, slots)
    assert rel_rms(o, o_r) < BARS[dtype] and rel_rms(new, pool_r) < BARS[dtype]
