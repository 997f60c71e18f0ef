"""Op- and module-level checks of the JAX code (float32 unless stated) against the float64 NumPy references.

JAX side: ``pallas_kernels.{kda,mla,indexer,moe}.reference`` and ``kimi_jax.modules.*``.
Reference side: ``np_reference`` (``ref``), written only from SPEC.md.

Error measures (``b`` is the float64 reference):
* ``max_rel(a, b) = max|a - b| / max|b|``  (bar ~1e-4 for fp32 KDA, tighter where the op is short);
* ``rel_rms(a, b) = ||a - b||_2 / ||b||_2`` (bar 5e-3 for bf16 inputs, SPEC §4).

Tie rules (both sides document the same rule, checked in ``test_indexer_topk_tie_rule`` and
``test_router_tie_rule``): indexer top-k -> the EARLIER position wins; router / group top-k -> the SMALLER id wins.
Exact-zero index scores (ReLU) make boundary ties common in practice (see ``test_mla_module_vs_ref``). One known
difference is kept as a strict xfail: ``jax.lax.top_k`` ranks -0.0 below +0.0, NumPy treats them as equal.

Modules are built with ``weights_np.numpy_init`` (abstract init + NumPy values, no per-shape ``jax.random``
compiles) and called through jitted wrappers, to keep this file fast on CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import np_reference as ref
import weights_np as wnp
from kimi_jax.config import IndexerConfig, MLAConfig, MoEConfig, get_preset
from kimi_jax.modules import layers as L
from kimi_jax.modules.attn_res import AttnResMix
from kimi_jax.modules.kda import KDACache, KimiDeltaAttention
from kimi_jax.modules.mla import MLACache, MultiHeadLatentAttention
from kimi_jax.modules.moe import MoE, route
from pallas_kernels.indexer import reference as index_ops
from pallas_kernels.kda import reference as kda_ops


def max_rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def rel_rms(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.sum((a - b) ** 2) / np.sum(b ** 2)))


def f64(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


TINY = get_preset("tiny")

# jitted entry points: one XLA compile per input shape instead of one per primitive (eager dispatch is slower here)
kda_recurrent = jax.jit(kda_ops.recurrent)
kda_chunk = jax.jit(kda_ops.chunk, static_argnames=("chunk_size",))
causal_conv = jax.jit(kda_ops.causal_conv)
topk_mask = jax.jit(index_ops.topk_mask, static_argnames=("topk",))
route_jit = jax.jit(route, static_argnames=("cfg",))


@nnx.jit
def kda_call(mod, x, cache):
    return mod(x, cache)


@functools.partial(nnx.jit, static_argnames=("form",))
def mla_call(mod, x, cache, start, form):
    return mod(x, cache, start, form=form)


@nnx.jit
def module_call(mod, *args):
    return mod(*args)


# =================================================================================================== KDA ops (§4)

B_KDA, T_KDA, H_KDA, DK, DV = 2, 150, 2, 16, 24  # T not a multiple of the chunk (64): 64 + 64 + 22


def _kda_inputs(seed: int, form: str, dtype=jnp.float32):
    """q, k (l2-normalised), v, g (from `kda_ops.gate`), beta, S0 as JAX arrays of `dtype` (g float32).

    The gate inputs spread z = f + dt_bias over roughly [-10, 8] and A = exp(A_log) over [1, 16], so every head
    mixes channels with almost no decay (long memory across chunks) and channels with strong decay:
    lower-bound form g in (-5, 0); plain form g down to about -130 per step.
    """
    r = np.random.default_rng(seed)
    sh = (B_KDA, T_KDA, H_KDA)
    q = kda_ops.l2norm(jnp.asarray(r.standard_normal(sh + (DK,)), jnp.float32))
    k = kda_ops.l2norm(jnp.asarray(r.standard_normal(sh + (DK,)), jnp.float32))
    v = jnp.asarray(r.standard_normal(sh + (DV,)), jnp.float32)
    f = jnp.asarray(3.0 * r.standard_normal(sh + (DK,)), jnp.float32)
    a_log = jnp.asarray(np.log(r.uniform(1.0, 16.0, H_KDA)), jnp.float32)
    dt = jnp.asarray(r.standard_normal((H_KDA, DK)) - 1.0, jnp.float32)
    g = kda_ops.gate(f, a_log, dt, form, -5.0)
    beta = jax.nn.sigmoid(jnp.asarray(r.standard_normal(sh), jnp.float32))
    S0 = jnp.asarray(r.standard_normal((B_KDA, H_KDA, DK, DV)), jnp.float32)
    cast = lambda a: a.astype(dtype)  # noqa: E731
    return cast(q), cast(k), cast(v), g if dtype == jnp.float32 else cast(g), cast(beta), S0


def _kda_ref(q, k, v, g, beta, S0):
    """float64 recurrence per batch row on exactly the (possibly bf16-rounded) inputs; q gets the d^-0.5 here."""
    q, k, v, g, beta = (f64(a) for a in (q, k, v, g, beta))
    outs, states = [], []
    for b in range(q.shape[0]):
        o, S = ref.kda_recurrence(q[b] * DK ** -0.5, k[b], v[b], g[b], beta[b],
                                  None if S0 is None else f64(S0[b]))
        outs.append(o)
        states.append(S)
    return np.stack(outs), np.stack(states)


@pytest.fixture(scope="module", params=["lower_bound", "plain"])
def kda_case(request):
    form = request.param
    q, k, v, g, beta, S0 = _kda_inputs(1 if form == "lower_bound" else 2, form)
    gmin = float(jnp.min(g))
    # strong decay is actually present, and so are long-memory channels
    assert gmin < (-4.9 if form == "lower_bound" else -20.0)
    assert float(jnp.max(g)) > -1e-3
    refs = {init: _kda_ref(q, k, v, g, beta, S0 if init else None) for init in (False, True)}
    return form, (q, k, v, g, beta, S0), refs


@pytest.mark.parametrize("op", ["recurrent", "chunk"])
@pytest.mark.parametrize("init", [False, True], ids=["zero_state", "initial_state"])
def test_kda_op_fp32_vs_fp64(kda_case, op, init):
    form, (q, k, v, g, beta, S0), refs = kda_case
    fn = kda_recurrent if op == "recurrent" else kda_chunk
    o, S = fn(q, k, v, g, beta, S0 if init else None)
    o_ref, S_ref = refs[init]
    assert o.dtype == jnp.float32 and S.dtype == jnp.float32
    assert o.shape == (B_KDA, T_KDA, H_KDA, DV) and S.shape == (B_KDA, H_KDA, DK, DV)
    err_o, err_s = max_rel(o, o_ref), max_rel(S, S_ref)
    assert err_o < 1e-4, f"{op}/{form} output max rel err {err_o:.2e}"
    assert err_s < 1e-4, f"{op}/{form} final state max rel err {err_s:.2e}"


@pytest.mark.parametrize("op", ["recurrent", "chunk"])
def test_kda_op_bf16_inputs(op):
    q, k, v, g, beta, S0 = _kda_inputs(3, "lower_bound", jnp.bfloat16)
    fn = kda_recurrent if op == "recurrent" else kda_chunk
    o, S = fn(q, k, v, g, beta, S0)
    assert o.dtype == jnp.bfloat16 and S.dtype == jnp.float32
    o_ref, S_ref = _kda_ref(q, k, v, g, beta, S0)
    assert rel_rms(o, o_ref) < 5e-3
    assert rel_rms(S, S_ref) < 5e-3


def test_kda_chunk_equals_recurrent_short_and_chunk_sizes():
    """T = 1 and T = 65 (one token past a chunk), and a non-default chunk size, all against fp64."""
    q, k, v, g, beta, S0 = _kda_inputs(4, "plain")
    for T, cs in ((1, 64), (65, 64), (37, 16)):
        args = [a[:, :T] for a in (q, k, v, g, beta)]
        o, S = kda_chunk(*args, S0, chunk_size=cs)
        o_ref, S_ref = _kda_ref(*args, S0)
        assert max_rel(o, o_ref) < 1e-4 and max_rel(S, S_ref) < 1e-4, (T, cs)


def test_kda_gate_forms_vs_ref():
    r = np.random.default_rng(5)
    B, T, H, d = 2, 7, 3, 8
    f = r.standard_normal((B, T, H, d)) * 6.0
    f[0, 0, 0, :3] = [25.0, 19.5, 40.0]  # around the softplus threshold (20)
    a_log = np.log(r.uniform(0.5, 16.0, H))
    dt = r.standard_normal((H, d))
    for form in ("lower_bound", "plain"):
        g = kda_ops.gate(jnp.asarray(f, jnp.float32), jnp.asarray(a_log, jnp.float32),
                         jnp.asarray(dt, jnp.float32), form, -5.0)
        fj, aj, dj = f64(f), f64(a_log), f64(dt)  # the float32-rounded inputs
        g_ref = np.stack([ref.kda_gate(fj[b].reshape(T, H * d), aj, dj.reshape(-1), form, -5.0, d)
                          for b in range(B)])
        assert g.dtype == jnp.float32 and g.shape == (B, T, H, d)
        np.testing.assert_allclose(f64(g), g_ref, rtol=1e-5, atol=1e-6)
        if form == "lower_bound":
            assert np.all(g_ref >= -5.0) and np.all(g_ref <= 0.0) and g_ref.min() < -4.9
    with pytest.raises(ValueError):
        kda_ops.gate(jnp.zeros((1, 1, H, d)), jnp.zeros(H), jnp.zeros((H, d)), "bogus")


def test_causal_conv_with_tails():
    r = np.random.default_rng(6)
    B, P, K = 2, 12, 4
    w = r.standard_normal((K, P)).astype(np.float32)
    x = r.standard_normal((B, 17, P)).astype(np.float32)
    tail0 = r.standard_normal((B, K - 1, P)).astype(np.float32)
    full_ref = [ref.causal_depthwise_conv(x[b], w.T, tail0[b]) for b in range(B)]
    # one call, with and without a history
    out, tail = causal_conv(jnp.asarray(x), jnp.asarray(w), jnp.asarray(tail0))
    for b in range(B):
        np.testing.assert_allclose(f64(out[b]), full_ref[b][0], rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(f64(tail[b]), full_ref[b][1])
    out0, _ = causal_conv(jnp.asarray(x), jnp.asarray(w), None)
    np.testing.assert_allclose(f64(out0[0]), ref.causal_depthwise_conv(x[0], w.T)[0], rtol=1e-5, atol=1e-5)
    # chained pieces, including pieces shorter than the tail (T = 1, 2 < K - 1)
    tail_j, outs, s = jnp.asarray(tail0), [], 0
    for n in (5, 1, 2, 9):
        o, tail_j = causal_conv(jnp.asarray(x[:, s:s + n]), jnp.asarray(w), tail_j)
        outs.append(o)
        s += n
        for b in range(B):  # the carried tail is always the last K-1 inputs
            np.testing.assert_array_equal(
                f64(tail_j[b]), np.concatenate([tail0[b], x[b, :s]])[-(K - 1):])
    chained = np.concatenate([f64(o) for o in outs], axis=1)
    for b in range(B):
        np.testing.assert_allclose(chained[b], full_ref[b][0], rtol=1e-5, atol=1e-5)


def test_l2norm_vs_ref():
    r = np.random.default_rng(7)
    x = r.standard_normal((4, 5, 16)).astype(np.float32)
    x[0, 0] = 0.0          # zero vector -> zeros
    x[0, 1] = 1e-4         # sum(x^2) = 1.6e-7 < eps: eps inside the sqrt matters
    x[0, 2] *= 1e3
    y = kda_ops.l2norm(jnp.asarray(x))
    np.testing.assert_allclose(f64(y), ref.l2norm(x, 1e-6), rtol=1e-6, atol=1e-7)
    assert np.all(f64(y[0, 0]) == 0.0)
    yb = kda_ops.l2norm(jnp.asarray(x, jnp.bfloat16))
    assert yb.dtype == jnp.float32
    np.testing.assert_allclose(f64(yb), ref.l2norm(f64(jnp.asarray(x, jnp.bfloat16)), 1e-6),
                               rtol=1e-6, atol=1e-7)


# ====================================================================================== KDA module (§4), with cache

def test_kda_module_vs_ref_and_cache():
    """KimiDeltaAttention: full prefill (chunked, 2 chunks) vs ref.kda_layer, then prefill 66 + 4 decode steps."""
    cfg = TINY.kda
    D, T = TINY.hidden_size, 70
    mod = wnp.numpy_init(lambda: KimiDeltaAttention(D, cfg, rngs=nnx.Rngs(0)), 11)
    w = wnp.kda_weights(mod, cfg)
    assert w["A_log"].shape == (cfg.a_log_checkpoint_size,)  # padded like a K3 checkpoint
    rc = wnp.kda_ref_cfg(cfg)
    x = np.random.default_rng(8).standard_normal((2, T, D)).astype(np.float32)
    out, cache = kda_call(mod, jnp.asarray(x), None)
    refs = [ref.kda_layer(x[b], w, rc) for b in range(2)]
    o_ref = np.stack([r_[0] for r_ in refs])
    assert max_rel(out, o_ref) < 1e-4
    assert max_rel(cache.state_bhkv, np.stack([r_[1]["S"] for r_ in refs])) < 1e-4
    for name in ("q", "k", "v"):
        np.testing.assert_allclose(f64(getattr(cache, f"{name}_tail_bkp")),
                                   np.stack([r_[1][f"conv_{name}"] for r_ in refs]), rtol=1e-5, atol=1e-5)
    # prefill 66 tokens (chunked: 64 + 2), then one token at a time (recurrent) with the carried cache
    o1, c = kda_call(mod, jnp.asarray(x[:, :66]), KDACache.zeros(2, cfg, jnp.float32))
    steps = [o1]
    for t in range(66, T):
        o_t, c = kda_call(mod, jnp.asarray(x[:, t:t + 1]), c)
        steps.append(o_t)
    assert max_rel(jnp.concatenate(steps, axis=1), o_ref) < 1e-4
    assert max_rel(c.state_bhkv, cache.state_bhkv) < 1e-4


def test_kda_module_in_bf16_hands_q_k_v_to_the_delta_rule_in_bf16(monkeypatch):
    """As transformers' conv (cast back to the hidden states' dtype) and fla's in-kernel l2norm leave them: a bf16
    layer's q, k (L2-normalised) and v reach the chunked and the recurrent op in bf16 (the GPU kernels' products
    then run on the tensor cores), the gate g and β in float32; a float32 layer keeps float32 throughout."""
    from sharding import kda as kda_sharded

    seen = []
    for op in ("chunk", "recurrent"):
        real = getattr(kda_sharded, op)

        def spy(ctx, q, k, v, g, beta, state, real=real, op=op, **kw):
            seen.append((op, q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype))
            return real(ctx, q, k, v, g, beta, state, **kw)

        monkeypatch.setattr(kda_sharded, op, spy)
    cfg, D = TINY.kda, TINY.hidden_size
    x = np.random.default_rng(3).standard_normal((1, 5, D)).astype(np.float32)
    for dt in (jnp.bfloat16, jnp.float32):
        mod = KimiDeltaAttention(D, cfg, rngs=nnx.Rngs(0), dtype=dt)
        _, cache = mod(jnp.asarray(x, dt))
        mod(jnp.asarray(x[:, :1], dt), cache)
        f32 = jnp.dtype(jnp.float32)
        assert seen == [(op, jnp.dtype(dt), jnp.dtype(dt), jnp.dtype(dt), f32, f32) for op in ("chunk", "recurrent")]
        seen.clear()


# ================================================================================================ MLA module (§5)

def _mla_module(q_lora: bool, gate: bool, indexer: bool, seed: int):
    m = TINY.mla
    mcfg = MLAConfig(num_heads=2, q_lora_rank=32 if q_lora else None, kv_lora_rank=24, qk_nope_head_dim=16,
                     qk_rope_head_dim=8, v_head_dim=12, output_gate=gate, rope=None,
                     q_norm_eps=m.q_norm_eps, kv_norm_eps=1e-6)
    icfg = IndexerConfig(num_heads=2, head_dim=16, topk=8, rope_dims=0, norm_eps=1e-5) if indexer else None
    mod = wnp.numpy_init(lambda: MultiHeadLatentAttention(TINY.hidden_size, mcfg, icfg, rngs=nnx.Rngs(0)), seed)
    return mod, mcfg, icfg


@pytest.mark.parametrize("q_lora,gate,indexer", [(True, True, True), (True, True, False), (False, False, False)],
                         ids=["k31_gated_dsa", "k3_gated", "kimi_linear_qproj"])
@pytest.mark.parametrize("form", ["naive", "absorbed"])
def test_mla_module_vs_ref(q_lora, gate, indexer, form):
    mod, mcfg, icfg = _mla_module(q_lora, gate, indexer, seed=21)
    w = wnp.mla_weights(mod, mcfg)
    rc = wnp.mla_ref_cfg(mcfg, icfg)
    T = 20  # > indexer top-k (8): rows t >= 8 are sparse
    x = np.random.default_rng(9).standard_normal((2, T, TINY.hidden_size)).astype(np.float32)
    out, new_cache = mla_call(mod, jnp.asarray(x), None, jnp.zeros((), jnp.int32), form)
    assert new_cache is None
    refs, ties_at_boundary = [], 0
    for b in range(2):
        keep = None
        if indexer:
            cq = ref.mla_q_latent(x[b], w, rc)
            sc = ref.indexer_scores(x[b], cq, w["indexer"], rc)
            keep = ref.indexer_keep_mask(sc, 8)
            assert keep.sum(1).max() == 8 and not np.all(keep[T - 1, :T])
            # ReLU makes exact-zero scores common; with these seeds some rows have their top-k boundary inside a
            # run of equal zeros, so the shared tie rule (earlier position wins) is exercised, not just untied data
            kth = np.sort(sc, axis=1)[:, ::-1]
            ties_at_boundary += int(np.sum(kth[8:, 7] == kth[8:, 8]))
        f = ref.mla_attention if form == "naive" else ref.mla_absorbed
        refs.append(f(x[b], w, rc, keep_mask_ts=keep))
    assert max_rel(out, np.stack(refs)) < 1e-5  # observed ~3e-7
    if indexer:  # the sparsity matters: dense attention gives a clearly different answer
        assert ties_at_boundary > 0
        dense = np.stack([ref.mla_attention(x[b], w, rc) for b in range(2)])
        assert max_rel(dense, np.stack(refs)) > 1e-2


def test_mla_module_cache_decode():
    """Prefill 14 tokens into a 20-token cache, then 6 single-token steps (absorbed) == the full forward."""
    mod, mcfg, icfg = _mla_module(True, True, True, seed=22)
    T = 20
    x = jnp.asarray(np.random.default_rng(10).standard_normal((2, T, TINY.hidden_size)), jnp.float32)
    full, _ = mla_call(mod, x, None, jnp.zeros((), jnp.int32), "naive")
    cache = MLACache.zeros(2, T, mcfg, icfg, jnp.float32)
    o, cache = mla_call(mod, x[:, :14], cache, jnp.asarray(0, jnp.int32), "absorbed")
    outs = [o]
    for t in range(14, T):
        o, cache = mla_call(mod, x[:, t:t + 1], cache, jnp.asarray(t, jnp.int32), "absorbed")
        outs.append(o)
    assert max_rel(jnp.concatenate(outs, axis=1), full) < 1e-5


# =========================================================================================== indexer top-k (§6)

def test_indexer_scores_vs_ref():
    mod, mcfg, icfg = _mla_module(True, True, True, seed=23)
    w = wnp.mla_weights(mod, mcfg)
    rc = wnp.mla_ref_cfg(mcfg, icfg)
    T = 12
    x = np.random.default_rng(11).standard_normal((2, T, TINY.hidden_size)).astype(np.float32)
    xj = jnp.asarray(x)
    ix = mod.indexer
    cq = mod.q_a_layernorm(mod.q_a_proj(xj))
    q = ix.wq_b(cq).reshape(2, T, icfg.num_heads, icfg.head_dim)
    wts = ix.weights_proj(xj, out_dtype=jnp.float32) * (icfg.num_heads ** -0.5 * icfg.head_dim ** -0.5)
    allowed = jnp.tril(jnp.ones((T, T), bool))[None].repeat(2, 0)
    s = f64(index_ops.scores(q, ix.keys(xj, None), wts, allowed))
    for b in range(2):
        s_ref = ref.indexer_scores(x[b], ref.mla_q_latent(x[b], w, rc), w["indexer"], rc)
        fin = np.isfinite(s_ref)
        assert np.array_equal(fin, np.isfinite(s[b]))
        np.testing.assert_allclose(s[b][fin], s_ref[fin], rtol=1e-5, atol=1e-5 * np.abs(s_ref[fin]).max())


@pytest.mark.parametrize("T,topk", [(20, 8), (6, 8), (9, 8), (33, 1)])
def test_indexer_topk_mask_untied(T, topk):
    """Untied random scores: keep-mask identical to ref.indexer_keep_mask (rows t+1 <= k keep everything)."""
    r = np.random.default_rng(12 + T)
    B = 2
    sc = r.standard_normal((B, T, T)).astype(np.float32)
    allowed = np.tril(np.ones((T, T), bool))[None].repeat(B, 0)
    sc = np.where(allowed, sc, -np.inf)
    keep = np.asarray(topk_mask(jnp.asarray(sc), jnp.asarray(allowed), topk))
    for b in range(B):
        np.testing.assert_array_equal(keep[b], ref.indexer_keep_mask(sc[b], topk))


def test_indexer_topk_tie_rule():
    """Exact ties (equal bit patterns): both sides keep the EARLIER position."""
    T, topk = 10, 3
    sc = np.tile(np.array([1.0, 2.0, 2.0, 1.0, 2.0, 2.0, 0.0, 2.0, 0.0, 0.0], np.float32), (T, 1))
    sc[9] = [0.0, 5.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    allowed = np.tril(np.ones((T, T), bool))
    sc = np.where(allowed, sc, -np.inf)
    keep = np.asarray(topk_mask(jnp.asarray(sc[None]), jnp.asarray(allowed[None]), topk))[0]
    keep_ref = ref.indexer_keep_mask(sc, topk)
    np.testing.assert_array_equal(keep, keep_ref)
    assert list(np.nonzero(keep[9])[0]) == [0, 1, 2]          # 5.0, then the two EARLIEST zeros
    assert list(np.nonzero(keep[7])[0]) == [1, 2, 4]


def test_indexer_topk_signed_zero_tie():
    T, topk = 4, 2
    sc = np.where(np.tril(np.ones((T, T), bool)), np.float32(0.0), -np.inf).astype(np.float32)
    sc[3] = [-0.0, -0.0, 0.0, 0.0]
    allowed = np.tril(np.ones((T, T), bool))
    keep = np.asarray(topk_mask(jnp.asarray(sc[None]), jnp.asarray(allowed[None]), topk))[0]
    np.testing.assert_array_equal(keep, ref.indexer_keep_mask(sc, topk))


# ================================================================================================ router (§7)

@pytest.mark.parametrize("groups,topk_groups,renorm,scale", [(1, 1, True, 1.0), (4, 2, True, 2.5),
                                                             (4, 1, False, 1.0), (8, 3, True, 1.7)])
def test_router_vs_ref_dense(groups, topk_groups, renorm, scale):
    E, k, N, D = 16, 4, 64, 32
    cfg = MoEConfig(num_experts=E, top_k=k, intermediate_size=8, num_groups=groups, topk_groups=topk_groups,
                    renormalize=renorm, routed_scaling_factor=scale)
    r = np.random.default_rng(13 + groups)
    x = r.standard_normal((N, D)).astype(np.float32)
    gate_de = (r.standard_normal((D, E)) * D ** -0.5).astype(np.float32)
    bias = (0.3 * r.standard_normal(E)).astype(np.float32)  # large enough to change selections
    w, idx = route_jit(jnp.asarray(x), jnp.asarray(gate_de), jnp.asarray(bias), cfg)
    assert w.dtype == jnp.float32 and idx.dtype == jnp.int32 and w.shape == (N, k)
    dense = np.zeros((N, E))
    np.put_along_axis(dense, np.asarray(idx), f64(w), axis=-1)
    dense_ref = ref.router_dense(x, gate_de.T, bias, k, groups, topk_groups, renorm, scale)
    np.testing.assert_array_equal(dense != 0, dense_ref != 0)   # same expert sets
    np.testing.assert_allclose(dense, dense_ref, rtol=1e-6, atol=1e-7)
    # the bias changes selections but never enters the weights
    dense_nobias = ref.router_dense(x, gate_de.T, None, k, groups, topk_groups, renorm, scale)
    assert np.any((dense_nobias != 0) != (dense_ref != 0))
    if groups > 1:  # experts come only from the kept groups
        used_groups = (dense_ref != 0).reshape(N, groups, E // groups).any(-1).sum(-1)
        assert np.all(used_groups <= topk_groups)


def test_router_tie_rule():
    """All scores equal: both sides pick the smallest expert ids (and, with groups, the smallest group ids)."""
    E, k, D = 16, 3, 8
    x = np.ones((2, D), np.float32)
    for groups, tg in ((1, 1), (4, 2)):
        cfg = MoEConfig(num_experts=E, top_k=k, intermediate_size=8, num_groups=groups, topk_groups=tg)
        w, idx = route_jit(jnp.asarray(x), jnp.zeros((D, E)), jnp.zeros(E), cfg)
        _, idx_ref = ref.router(x, np.zeros((E, D)), None, k, groups, tg)
        np.testing.assert_array_equal(np.sort(np.asarray(idx), -1), np.sort(idx_ref, -1))
        np.testing.assert_array_equal(np.sort(idx_ref, -1), [[0, 1, 2]] * 2)
        np.testing.assert_allclose(f64(w), np.full((2, k), 1 / k), rtol=1e-6)


# ============================================================================================ activations (§7)

def test_situ_and_gated_activations():
    r = np.random.default_rng(14)
    g = np.concatenate([r.standard_normal(500) * 4, np.linspace(-80, 80, 101)]).astype(np.float32)
    u = np.concatenate([r.standard_normal(500) * 30, np.linspace(-200, 200, 101)]).astype(np.float32)
    gj, uj = jnp.asarray(g), jnp.asarray(u)
    for name, fn in (("situ", lambda a, b: L.situ(a, b, 4.0, 25.0)), ("swiglu", L.swiglu),
                     ("clamped_swiglu", L.clamped_swiglu)):
        y = fn(gj, uj)
        assert y.dtype == jnp.float32
        y_ref = ref.activation(name, g, u)
        np.testing.assert_allclose(f64(y), y_ref, rtol=2e-6, atol=2e-6 * np.abs(y_ref).max(), err_msg=name)
    # the configured activation of the tiny preset is SiTU with beta 4 / 25
    y = L.activation_fn(TINY)(gj, uj)
    np.testing.assert_allclose(f64(y), ref.situ(g, u, TINY.situ_beta, TINY.situ_linear_beta),
                               rtol=2e-6, atol=1e-5)
    # bf16 inputs are computed in float32
    yb = L.situ(gj.astype(jnp.bfloat16), uj.astype(jnp.bfloat16))
    assert yb.dtype == jnp.float32
    np.testing.assert_allclose(f64(yb), ref.situ(f64(gj.astype(jnp.bfloat16)), f64(uj.astype(jnp.bfloat16))),
                               rtol=2e-6, atol=1e-5)


# =================================================================================================== MoE (§7)

@pytest.mark.parametrize("kind", ["standard_swiglu_groups", "latent_situ"])
def test_moe_module_vs_ref(kind):
    D = TINY.hidden_size
    if kind == "latent_situ":
        cfg = TINY.moe
        act_name = "situ"
    else:
        cfg = MoEConfig(num_experts=8, top_k=3, intermediate_size=24, num_shared_experts=1, num_groups=4,
                        topk_groups=2, routed_scaling_factor=2.5)
        act_name = "swiglu"
    act = (lambda g_, u_: L.situ(g_, u_, 4.0, 25.0)) if act_name == "situ" else L.swiglu
    mod = wnp.numpy_init(lambda: MoE(D, cfg, act, 1e-5, rngs=nnx.Rngs(0)), 31)
    w = wnp.moe_weights(mod)
    rc = wnp.moe_ref_cfg(cfg, activation=act_name, norm_eps=1e-5)
    x = np.random.default_rng(15).standard_normal((2, 10, D)).astype(np.float32)
    y = module_call(mod, jnp.asarray(x))
    assert y.shape == x.shape and y.dtype == jnp.float32
    y_ref = ref.moe(x.reshape(-1, D), w, rc).reshape(x.shape)
    assert max_rel(y, y_ref) < 2e-5
    # routed part alone also matches (shared experts would otherwise dominate a weak mismatch)
    w_routed = {k_: v_ for k_, v_ in w.items() if k_ != "shared_experts"}
    shared = f64(module_call(mod.shared_experts, jnp.asarray(x))) if mod.shared_experts is not None else 0.0
    assert max_rel(f64(y) - shared, ref.moe(x.reshape(-1, D), w_routed, rc).reshape(x.shape)) < 5e-5


# ============================================================================================== AttnRes (§3)

@pytest.mark.parametrize("S", [1, 2, 4])
def test_attn_res_mix_vs_ref(S):
    D = TINY.hidden_size
    mix = wnp.numpy_init(lambda: AttnResMix(D, 1e-5, rngs=nnx.Rngs(0)), 41)
    r = np.random.default_rng(16)
    srcs = [(r.standard_normal((2, 5, D)) * (1.0 + 3 * s_)).astype(np.float32) for s_ in range(S)]
    h = module_call(mix, [jnp.asarray(s_) for s_ in srcs])
    proj, norm = wnp.attn_res_weights(mix)
    h_ref = ref.attn_res_mix(srcs, proj, norm, 1e-5)
    assert h.dtype == jnp.float32 and h.shape == (2, 5, D)
    assert max_rel(h, h_ref) < 1e-5
    # stacked-array input is accepted too
    np.testing.assert_array_equal(np.asarray(module_call(mix, jnp.stack([jnp.asarray(s_) for s_ in srcs]))), np.asarray(h))


def test_op_interface_names_of_design():
    """DESIGN.md's op interface: `pallas_kernels.kda.chunk / .recurrent`, `pallas_kernels.indexer...`,
    `pallas_kernels.sparse_mla...`, `pallas_kernels.moe...` are importable by those names."""
    import pallas_kernels.indexer as indexer
    import pallas_kernels.kda as kda
    import pallas_kernels.moe as moe
    import pallas_kernels.sparse_mla as sparse_mla
    from pallas_kernels.indexer import paged
    from pallas_kernels.mla import sparse
    from pallas_kernels.moe import ops

    assert callable(kda.chunk) and callable(kda.recurrent)
    assert indexer.decode is paged.decode and indexer.prefill is paged.prefill
    assert sparse_mla.decode is sparse.decode and sparse_mla.sparse_mla is sparse.sparse_mla
    assert moe.grouped_matmul is ops.grouped_matmul and moe.expert_ffn is ops.expert_ffn


def test_a_one_row_linear_stays_a_matmul_when_lowered_for_a_gpu():
    """XLA's GPU compiler turns a one-row dot into a multiply and a reduction; `layers.matmul` lowers a single row
    for a GPU as a two-row dot (the zero row sliced away) and elsewhere as the plain dot, with the same values."""
    import re

    from kimi_jax.modules.layers import matmul

    x = jax.random.normal(jax.random.key(0), (1, 1, 64))
    w = jax.random.normal(jax.random.key(1), (64, 96))
    np.testing.assert_array_equal(np.asarray(matmul(x, w)), np.asarray(jnp.dot(x, w)))
    fn = jax.jit(matmul)

    def dot_lhs_shapes(platform):
        text = jax.export.export(fn, platforms=[platform])(x, w).mlir_module()
        return set(re.findall(r"stablehlo\.dot_general[^\n]*: \(tensor<([0-9x]+)xf32>", text))

    assert dot_lhs_shapes("cuda") == {"2x64"}
    assert dot_lhs_shapes("tpu") == {"1x1x64"}
    assert matmul(jnp.ones((3, 64)), w).shape == (3, 96)  # more rows: the plain dot everywhere
    # the MoE router's float32 matmul at one token takes the same form
    from pallas_kernels.moe.routing import router_logits

    fn = jax.jit(router_logits)
    x = x.reshape(1, 64)
    np.testing.assert_array_equal(np.asarray(fn(x, w)), np.asarray(jnp.dot(x, w, precision="highest")))
    assert dot_lhs_shapes("cuda") == {"2x64"} and dot_lhs_shapes("tpu") == {"1x64"}
