"""KDA kernels (pallas_kernels/kda) against the reference recurrence: the shared chunk math, the TPU kernels and the
backend-independent contracts of `ops`; the GPU (native Triton) kernels' own checks, on CPU and on a device, are in
tests/test_triton_kda.py (and their sm_90 compile in tests/test_triton_compile.py), which share this file's inputs.

CPU: the TPU kernels run in Pallas TPU interpret mode, the GPU kernels in Triton's interpreter (backend
"gpu_interpret"; tests/conftest.py sets TRITON_INTERPRET=1); the TPU kernels are also lowered to Mosaic (no device
needed). Bars (issue #4): relative RMS error < 1e-4 on fp32 inputs, < 5e-3 on bf16 inputs, outputs and final states
checked separately.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import chunk_math, ops, reference as R

FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
BARS = {jnp.float32: 1e-4, jnp.bfloat16: 5e-3}


def rel_rms(x, ref):
    x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    ref = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
    assert np.all(np.isfinite(x)), "non-finite values"
    return float(np.sqrt(np.mean((x - ref) ** 2) / np.mean(ref ** 2)))


def inputs(seed, B, T, H, dk, dv, g_lo, g_hi, dtype):
    r = np.random.default_rng(seed)
    q = R.l2norm(jnp.asarray(r.standard_normal((B, T, H, dk)), jnp.float32)).astype(dtype)
    k = R.l2norm(jnp.asarray(r.standard_normal((B, T, H, dk)), jnp.float32)).astype(dtype)
    v = jnp.asarray(r.standard_normal((B, T, H, dv)), jnp.float32).astype(dtype)
    g = jnp.asarray(r.uniform(g_lo, g_hi, (B, T, H, dk)), jnp.float32)
    # a mix of weak and strong decay channels: strong ones reach −20 per step
    g = jnp.where(jnp.asarray(r.uniform(size=(1, 1, H, dk)) < 0.5), g, g * 0.02)
    beta = jnp.asarray(r.uniform(0.05, 1.0, (B, T, H)), jnp.float32)
    return q, k, v, g, beta


def f32(*xs):
    return tuple(x.astype(jnp.float32) for x in xs)


def run_fast(fn, *args):
    """jit with a cheap XLA CPU compile (interpret-mode kernels are large graphs)."""
    return jax.jit(fn).lower(*args).compile(FAST)(*args)


KERNEL_BACKENDS = ["tpu_interpret", "gpu_interpret"]


# ------------------------------------------------------------------------------------------------------------------
# reference additions
# ------------------------------------------------------------------------------------------------------------------

def test_reference_varlen_equals_per_sequence_recurrence():
    cu = np.array([0, 16, 16, 32, 48])
    q, k, v, g, beta = inputs(0, 1, 48, 2, 8, 4, -3.0, -0.1, jnp.float32)
    s0 = jnp.asarray(np.random.default_rng(1).standard_normal((4, 2, 8, 4)), jnp.float32)
    o, sf = jax.jit(R.recurrent_varlen, static_argnums=5)(q, k, v, g, beta, tuple(cu), s0)
    rec = jax.jit(R.recurrent)
    for n in range(4):
        a, b = cu[n], cu[n + 1]
        sl = lambda x: x[:, a:b]
        if b > a:
            o_n, s_n = rec(*map(sl, (q, k, v, g, beta)), s0[n:n + 1])
            np.testing.assert_allclose(o[:, a:b], o_n, rtol=1e-5, atol=1e-6)
        else:
            s_n = s0[n:n + 1]
        np.testing.assert_allclose(sf[n:n + 1], s_n, rtol=1e-5, atol=1e-6)


def test_reference_slots_update_only_addressed_rows():
    q, k, v, g, beta = inputs(2, 2, 1, 2, 8, 8, -1.0, 0.0, jnp.float32)
    pool = jnp.asarray(np.random.default_rng(3).standard_normal((4, 2, 8, 8)), jnp.float32)
    o, new = R.recurrent_slots(q, k, v, g, beta, pool, jnp.array([3, 1]))
    o2, s2 = R.recurrent(q, k, v, g, beta, pool[jnp.array([3, 1])])
    np.testing.assert_allclose(o, o2, rtol=1e-6)
    np.testing.assert_allclose(new[jnp.array([3, 1])], s2, rtol=1e-6)
    np.testing.assert_array_equal(new[jnp.array([0, 2])], pool[jnp.array([0, 2])])


def test_chunk_table_varlen_alignment():
    tab = chunk_math.chunk_table(np.array([0, 3, 3, 70, 200]), 200, 64)
    assert tab.n_chunks == 1 + 0 + 2 + 3
    np.testing.assert_array_equal(tab.start, [0, 3, 67, 70, 134, 198])
    np.testing.assert_array_equal(tab.length, [3, 64, 3, 64, 64, 2])
    np.testing.assert_array_equal(tab.seq, [0, 2, 2, 3, 3, 3])
    np.testing.assert_array_equal(tab.first, [1, 1, 0, 1, 0, 0])
    np.testing.assert_array_equal(tab.seq_nchunks, [1, 0, 2, 3])
    traced = jax.jit(lambda cu: chunk_math.chunk_table(cu, 200, 64)[:4])(jnp.array([0, 3, 3, 70, 200]))
    np.testing.assert_array_equal(traced[0][:6], tab.start)
    np.testing.assert_array_equal(traced[1][6:], 0)


def test_unit_lower_inverse_is_exact_even_for_parallel_keys():
    """The loop-free (I + L)^-1 (products of (I + Nⁿ) + one Newton step) against float64, including nearly parallel
    keys (large cancelling terms) and the all-ones worst case."""
    dot = chunk_math.make_dot(jax.lax.Precision.HIGHEST)
    r = np.random.default_rng(0)
    base = r.standard_normal(64)
    k = base + 0.05 * r.standard_normal((16, 64))
    k /= np.linalg.norm(k, axis=1, keepdims=True)
    for L in (np.tril(k @ k.T, -1), np.tril(np.ones((16, 16)), -1),
              np.tril(r.standard_normal((16, 16)) * 0.3, -1)):
        X = np.asarray(chunk_math.unit_lower_inverse(jnp.asarray(L, jnp.float32), dot), np.float64)
        X_t = np.linalg.inv(np.eye(16) + L)
        assert np.abs(X - X_t).max() <= 1e-5 * np.abs(X_t).max()


@pytest.mark.parametrize("g_lo", [-5.0, -30.0])  # −5: every diagonal sub-block takes the one-matmul path; −30: none
def test_intra_chunk_fast_paths_equal_exact(g_lo):
    dot = chunk_math.make_dot(jax.lax.Precision.HIGHEST)
    r = np.random.default_rng(1)
    blk = lambda *s: [jnp.asarray(r.standard_normal(s) * 0.3, jnp.float32) for _ in range(4)]
    qb, kb, vb = blk(16, 32), blk(16, 32), blk(16, 16)
    gb = [jnp.asarray(r.uniform(g_lo, 0.0, (16, 32)), jnp.float32) for _ in range(4)]
    bb = [jnp.asarray(r.uniform(0.0, 1.0, (16, 1)), jnp.float32) for _ in range(4)]
    cs = lambda x: jnp.cumsum(x, axis=0)
    a = chunk_math.intra_chunk(qb, kb, vb, gb, bb, dot=dot, cumsum0=cs)
    b = chunk_math.intra_chunk(qb, kb, vb, gb, bb, dot=dot, cumsum0=cs, fast_diag=True, fast_inverse=True)
    for x, y in [(a.W, b.W), (a.U, b.U), (list(a.Aqk.values()), list(b.Aqk.values()))]:
        for u, w in zip(x, y):
            np.testing.assert_allclose(w, u, rtol=2e-5, atol=2e-6 * float(jnp.abs(u).max()) + 1e-30)


# ------------------------------------------------------------------------------------------------------------------
# chunked prefill kernels (interpret mode)
# ------------------------------------------------------------------------------------------------------------------

CU_MANY = np.array([0, 1, 9, 9, 26, 90, 93, 150])  # many short sequences, one empty, T = 150 (not a multiple of 64)


@pytest.mark.parametrize("backend", ["tpu_interpret"])  # the GPU kernels: tests/test_triton_kda.py
def test_chunk_varlen_fp32_strong_decay(backend):
    q, k, v, g, beta = inputs(10, 1, 150, 2, 32, 16, -30.0, -5.0, jnp.float32)
    N = len(CU_MANY) - 1
    s0 = jnp.asarray(np.random.default_rng(11).standard_normal((N, 2, 32, 16)), jnp.float32)
    fn = lambda *a: ops.chunk(*a[:5], initial_state=a[5], cu_seqlens=CU_MANY, backend=backend)
    o, sf = run_fast(fn, q, k, v, g, beta, s0)
    o_r, s_r = R.recurrent_varlen(q, k, v, g, beta, CU_MANY, s0)
    assert o.shape == o_r.shape and sf.shape == (N, 2, 32, 16)
    assert rel_rms(o, o_r) < BARS[jnp.float32]
    assert rel_rms(sf, s_r) < BARS[jnp.float32]
    np.testing.assert_allclose(sf[2], s0[2])  # the empty sequence keeps its initial state


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_chunk_batch_bf16_fused_gate(backend):
    """Uniform batch (no cu_seqlens), T = 100, K3 lower-bound gate fused; no initial state."""
    B, T, H, dk, dv = 2, 100, 3, 16, 32
    q, k, v, f, beta = inputs(12, B, T, H, dk, dv, -4.0, 4.0, jnp.bfloat16)
    r = np.random.default_rng(13)
    A_log = jnp.asarray(np.log(r.uniform(1, 16, H)), jnp.float32)
    dt_bias = jnp.asarray(r.standard_normal(H * dk), jnp.float32)
    fn = lambda *a: ops.chunk(*a, backend=backend, A_log=A_log, dt_bias=dt_bias, gate_form="lower_bound")
    o, sf = run_fast(fn, q, k, v, f, beta)
    g = R.gate(f, A_log, dt_bias.reshape(H, dk), "lower_bound")
    o_r, s_r = R.recurrent(*f32(q, k, v), g, beta)
    assert o.dtype == jnp.bfloat16 and o.shape == (B, T, H, dv)
    assert rel_rms(o, o_r) < BARS[jnp.bfloat16]
    assert rel_rms(sf, s_r) < BARS[jnp.bfloat16]


@pytest.mark.parametrize("backend,H", [("tpu_interpret", 96), ("gpu_interpret", 8)])
def test_chunk_k3_heads_bf16_short(backend, H):
    """d = 128 and H = 96 (K3 shape; H = 8 under the Triton interpreter, which copies whole buffers per grid step:
    H = 96 there is tests/test_triton_kda.py's `gpu` device test and bench/kda.py), kept short: one 20-token sequence
    with an initial state, g near −5 and below."""
    cu = np.array([0, 20])
    q, k, v, g, beta = inputs(14, 1, 20, H, 128, 128, -8.0, -4.5, jnp.bfloat16)
    s0 = jnp.asarray(np.random.default_rng(15).standard_normal((1, H, 128, 128)) * 0.1, jnp.float32)
    fn = lambda *a: ops.chunk(*a[:5], initial_state=a[5], cu_seqlens=cu, backend=backend)
    o, sf = run_fast(fn, q, k, v, g, beta, s0)
    o_r, s_r = jax.jit(R.recurrent_varlen, static_argnums=5)(*f32(q, k, v), g, beta, tuple(cu), s0)
    assert rel_rms(o, o_r) < BARS[jnp.bfloat16]
    assert rel_rms(sf, s_r) < BARS[jnp.bfloat16]


# ------------------------------------------------------------------------------------------------------------------
# decode kernels (interpret mode)
# ------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["tpu_interpret"])  # the GPU kernel: tests/test_triton_kda.py
@pytest.mark.parametrize("dtype,form", [(jnp.float32, "plain"), (jnp.bfloat16, "lower_bound")])
def test_recurrent_slots(backend, dtype, form):
    B, T, H, dk, dv, S = 3, 2, 2, 32, 64, 5
    q, k, v, f, beta = inputs(20, B, T, H, dk, dv, -6.0, 2.0, dtype)
    r = np.random.default_rng(21)
    pool = jnp.asarray(r.standard_normal((S, H, dk, dv)), jnp.float32)
    slots = jnp.array([4, 0, 2], jnp.int32)
    kw = {}
    g = f
    if form is not None:
        A_log = jnp.asarray(np.log(r.uniform(1, 16, H)), jnp.float32)
        dt_bias = jnp.asarray(r.standard_normal(H * dk), jnp.float32)
        kw = dict(A_log=A_log, dt_bias=dt_bias, gate_form=form)
        g = R.gate(f, A_log, dt_bias.reshape(H, dk), form)
    else:
        g = jnp.minimum(f, 0.0)
        f = g
    fn = lambda *a: ops.recurrent(*a[:5], a[5], slot_ids=a[6], backend=backend, **kw)
    o, new_pool = run_fast(fn, q, k, v, f, beta, pool, slots)
    o_r, pool_r = R.recurrent_slots(*f32(q, k, v), g, beta, pool, slots)
    bar = BARS[dtype]
    assert rel_rms(o, o_r) < bar
    assert rel_rms(new_pool[slots], pool_r[slots]) < bar
    np.testing.assert_array_equal(new_pool[jnp.array([1, 3])], pool[jnp.array([1, 3])])


def test_recurrent_donated_updates_in_place_shape():
    """The donated entry point keeps the pool's shape/dtype (the aliasing contract used by the engine)."""
    q, k, v, g, beta = inputs(30, 2, 1, 2, 16, 16, -1.0, 0.0, jnp.float32)
    pool = jnp.zeros((3, 2, 16, 16), jnp.float32)
    o, new = ops.recurrent_donated(q, k, v, g, beta, pool, slot_ids=jnp.array([2, 0]), backend="reference")
    assert new.shape == (3, 2, 16, 16) and new.dtype == jnp.float32 and o.shape == (2, 1, 2, 16)


# ------------------------------------------------------------------------------------------------------------------
# backend choice and lowering for the real platforms
# ------------------------------------------------------------------------------------------------------------------

def test_auto_backend_on_cpu_is_reference():
    if jax.default_backend() == "cpu":
        assert ops.resolve_backend("auto") == "reference"
    assert ops.resolve_backend("triton") == "gpu" and ops.resolve_backend("triton_interpret") == "gpu_interpret"
    with pytest.raises(ValueError):
        ops.resolve_backend("cuda-ish")


def test_auto_matches_reference_chunk():
    q, k, v, g, beta = inputs(40, 1, 70, 2, 16, 16, -2.0, 0.0, jnp.float32)
    o, s = jax.jit(functools.partial(ops.chunk, backend="reference"))(q, k, v, g, beta)
    o_r, s_r = jax.jit(R.recurrent)(q, k, v, g, beta)
    assert rel_rms(o, o_r) < 1e-5 and rel_rms(s, s_r) < 1e-5


@pytest.mark.parametrize("backend", ["reference"] + KERNEL_BACKENDS)
def test_no_tokens_leave_the_states_as_they_are(backend):
    """T = 0 (a batch, a packed batch of empty sequences, a decode step of no tokens) is a legal call on every
    backend: o is empty and the final states are the initial ones."""
    q, k, v, g, beta = inputs(41, 2, 0, 2, 16, 32, -1.0, 0.0, jnp.float32)
    s0 = jnp.asarray(np.random.default_rng(42).standard_normal((2, 2, 16, 32)), jnp.float32)
    o, s = ops.chunk(q, k, v, g, beta, initial_state=s0, backend=backend)
    assert o.shape == (2, 0, 2, 32)
    np.testing.assert_array_equal(s, s0)
    packed = tuple(a[:1] for a in (q, k, v, g, beta))
    o, s = ops.chunk(*packed, initial_state=s0, cu_seqlens=np.array([0, 0, 0]), backend=backend)
    assert o.shape == (1, 0, 2, 32)
    np.testing.assert_array_equal(s, s0)
    o, pool = ops.recurrent(q, k, v, g, beta, s0, backend=backend)
    assert o.shape == (2, 0, 2, 32)
    np.testing.assert_array_equal(pool, s0)


@pytest.mark.parametrize("backend", ["reference"] + KERNEL_BACKENDS)
def test_chunk_rejects_a_bad_packed_layout_on_every_backend(backend):
    """cu_seqlens must start at 0, not decrease and end at T, and initial_state must be [N or B, H, dk, dv]: a
    ValueError naming the constraint on every backend (the reference used to run a bad cu_seqlens, the GPU kernel
    a wrongly shaped initial state)."""
    q, k, v, g, beta = inputs(43, 1, 5, 1, 16, 16, -1.0, 0.0, jnp.float32)
    for cu in ([0, 3], [0, 4, 2, 5], [1, 5], [0, 6]):
        with pytest.raises(ValueError, match="cu_seqlens must be non-decreasing"):
            ops.chunk(q, k, v, g, beta, cu_seqlens=np.array(cu), backend=backend)
    with pytest.raises(ValueError, match="initial_state must be"):
        ops.chunk(q, k, v, g, beta, initial_state=jnp.zeros((1, 1, 16, 8)), backend=backend)
    with pytest.raises(ValueError, match="initial_state must be"):
        ops.chunk(q, k, v, g, beta, initial_state=jnp.zeros((3, 1, 16, 16)), cu_seqlens=np.array([0, 2, 5]),
                  backend=backend)


def _sds(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def test_tpu_kernels_lower_to_mosaic():
    from pallas_kernels.kda import tpu
    H, d, T = 2, 128, 130
    cu = np.array([0, 7, 130])
    args = (_sds((1, T, H, d)), _sds((1, T, H, d)), _sds((1, T, H, d)), _sds((1, T, H, d), jnp.float32),
            _sds((1, T, H), jnp.float32), _sds((2, H, d, d), jnp.float32))
    txt = jax.jit(lambda *a: tpu.chunk(*a[:5], cu, a[5])).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in txt
    dec = lambda *a: tpu.recurrent(*a[:5], a[5], a[6], A_log=jnp.zeros(H), dt_bias=jnp.zeros(H * d),
                                   gate_form="lower_bound")
    dargs = (_sds((4, 1, H, d)),) * 4 + (_sds((4, 1, H)), _sds((8, H, d, d), jnp.float32), _sds((4,), jnp.int32))
    txt = jax.jit(dec, donate_argnums=5).trace(*dargs).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in txt
