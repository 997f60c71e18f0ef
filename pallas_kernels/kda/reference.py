"""KDA (Kimi Delta Attention, docs/model.md §4) reference ops in plain jnp: the definition every kernel is tested
against.

Layout: q, k `[B, T, H, dk]`, v `[B, T, H, dv]`, g `[B, T, H, dk]` (log-decay, ≤ 0), beta `[B, T, H]`,
state `[B, H, dk, dv]` float32. q and k arrive L2-normalised; `scale` (default dk^-0.5) multiplies q here.
All math is float32; outputs are cast back to v's dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.scipy.linalg import solve_triangular


# Products in true float32 on every platform: the definition must not inherit the platform's default matmul precision
# (TF32 on Hopper GPUs: 3e-4 relative error, which the tiny model's top-k choices amplified to a 0.3 logit mismatch).
PRECISION = jax.lax.Precision.HIGHEST


def _einsum(*operands):
    return jnp.einsum(*operands, precision=PRECISION)


def _solve_unit_lower(unit_lower_bhcc, rhs_bhcx):
    """X `[B, H, C, x]` with L X = rhs for unit lower-triangular L `[B, H, C, C]`.

    On CPU: forward substitution, one row per step (row r uses the finished rows above it). jaxlib's batched
    LAPACK trsm spreads its batch over the same thread pool that runs each device's program; with several CPU
    devices (`--xla_force_host_platform_device_count`) that deadlocked a Kimi-Linear forward on a 1x8 mesh. Other
    platforms keep XLA's triangular solve."""
    def substitute(L, R):
        C = L.shape[-1]
        col = jnp.arange(C)

        def row(r, X):
            l_r = jnp.where(col < r, L[..., r, :], 0.0)  # only the finished rows above r
            return X.at[..., r, :].set(R[..., r, :] - _einsum("...c,...cx->...x", l_r, X))

        return jax.lax.fori_loop(1, C, row, R)

    def trsm(L, R):
        return solve_triangular(L, R, lower=True, unit_diagonal=True)

    return jax.lax.platform_dependent(unit_lower_bhcc, rhs_bhcx, cpu=substitute, default=trsm)


def _zeros_state(q, v):
    B, _, H, dk = q.shape
    return jnp.zeros((B, H, dk, v.shape[-1]), jnp.float32)


def recurrent(q_bthk, k_bthk, v_bthv, g_bthk, beta_bth, initial_state_bhkv=None, scale=None):
    """Token-by-token delta rule. Returns (o `[B, T, H, dv]` in v.dtype, final state `[B, H, dk, dv]` float32).

    Per head: S ← S·diag(exp g_t); S ← S + β_t k_t ⊗ (v_t − Sᵀk_t); o_t = Sᵀ q_t (read after the update).
    """
    dk = q_bthk.shape[-1]
    scale = dk ** -0.5 if scale is None else scale
    S0 = _zeros_state(q_bthk, v_bthv) if initial_state_bhkv is None else initial_state_bhkv.astype(jnp.float32)
    f32 = lambda a: jnp.moveaxis(a.astype(jnp.float32), 1, 0)  # time-major for scan
    xs = (f32(q_bthk) * scale, f32(k_bthk), f32(v_bthv), f32(g_bthk), f32(beta_bth))

    def step(S_bhkv, x):
        q_bhk, k_bhk, v_bhv, g_bhk, b_bh = x
        S_bhkv = S_bhkv * jnp.exp(g_bhk)[..., None]
        kS_bhv = _einsum("bhk,bhkv->bhv", k_bhk, S_bhkv)
        S_bhkv = S_bhkv + _einsum("bhk,bhv->bhkv", k_bhk, b_bh[..., None] * (v_bhv - kS_bhv))
        o_bhv = _einsum("bhk,bhkv->bhv", q_bhk, S_bhkv)
        return S_bhkv, o_bhv

    S, o_tbhv = jax.lax.scan(step, S0, xs)
    return jnp.moveaxis(o_tbhv, 0, 1).astype(v_bthv.dtype), S


def chunk(q_bthk, k_bthk, v_bthv, g_bthk, beta_bth, initial_state_bhkv=None, scale=None, chunk_size=64):
    """Chunked (WY) form of `recurrent`, equal to it up to rounding. Same arguments and returns.

    Within a chunk, Γ = inclusive cumsum of g. Every decay factor is formed as exp(Γ_r − Γ_c) with c ≤ r (or
    exp(Γ_last − Γ_c)), so each exponent is ≤ 0 and nothing overflows under strong decay.
    """
    B, T, H, dk = q_bthk.shape
    dv = v_bthv.shape[-1]
    C = chunk_size
    scale = dk ** -0.5 if scale is None else scale
    S0 = _zeros_state(q_bthk, v_bthv) if initial_state_bhkv is None else initial_state_bhkv.astype(jnp.float32)
    pad = (-T) % C
    N = (T + pad) // C

    def to_chunks(a):  # [B, T, H, ...] -> [N, B, H, C, ...]; padded steps have g = 0, beta = 0, k = v = 0
        a = a.astype(jnp.float32)
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        a = a.reshape(B, N, C, *a.shape[2:])
        a = jnp.moveaxis(a, 3, 2)  # [B, N, H, C, ...]
        return jnp.moveaxis(a, 1, 0)

    q, k, v, g, beta = map(to_chunks, (q_bthk * scale, k_bthk, v_bthv, g_bthk, beta_bth))
    row = jnp.arange(C)
    strictly_lower = row[:, None] > row[None, :]
    lower = row[:, None] >= row[None, :]
    eye = jnp.eye(C, dtype=jnp.float32)

    def step(S_bhkv, x):
        q_bhck, k_bhck, v_bhcv, g_bhck, b_bhc = x
        G = jnp.cumsum(g_bhck, axis=-2)  # Γ
        # pairwise decays exp(Γ_r − Γ_c), masked to c ≤ r BEFORE the exp so no positive exponent is ever taken
        diff_bhcck = G[..., :, None, :] - G[..., None, :, :]
        decay = jnp.exp(jnp.where(lower[:, :, None], diff_bhcck, -jnp.inf))
        Akk = _einsum("bhrk,bhck,bhrck->bhrc", k_bhck, k_bhck, decay) * b_bhc[..., :, None]
        Akk = jnp.where(strictly_lower, Akk, 0.0)
        Aqk = jnp.where(lower, _einsum("bhrk,bhck,bhrck->bhrc", q_bhck, k_bhck, decay), 0.0)
        unit_lower = Akk + eye  # T = (I + Akk)^-1, applied by a triangular solve
        eG = jnp.exp(G)
        # both right-hand sides in one solve: [β k e^Γ | β v]
        WU = _solve_unit_lower(unit_lower, jnp.concatenate([b_bhc[..., None] * k_bhck * eG,
                                                             b_bhc[..., None] * v_bhcv], axis=-1))
        W, U = WU[..., :dk], WU[..., dk:]
        Vn = U - _einsum("bhck,bhkv->bhcv", W, S_bhkv)
        O = _einsum("bhck,bhkv->bhcv", q_bhck * eG, S_bhkv) + _einsum("bhrc,bhcv->bhrv", Aqk, Vn)
        G_last = G[..., -1:, :]  # [B, H, 1, dk]
        S_new = jnp.exp(G_last[..., 0, :])[..., None] * S_bhkv + _einsum(
            "bhck,bhcv->bhkv", k_bhck * jnp.exp(G_last - G), Vn)
        return S_new, O

    S, O_nbhcv = jax.lax.scan(step, S0, (q, k, v, g, beta))
    O = jnp.moveaxis(O_nbhcv, 0, 1)  # [B, N, H, C, dv]
    O = jnp.moveaxis(O, 2, 3).reshape(B, N * C, H, dv)[:, :T]
    return O.astype(v_bthv.dtype), S


def gate(f_bthk, A_log_h, dt_bias_hk, form: str, lower_bound: float = -5.0):
    """Per-channel log-decay g `[B, T, H, dk]` float32 from the raw forget projection f (docs/model.md §4).

    lower_bound: g = lb · sigmoid(exp(A_log[h]) · (f + dt_bias))   (K3, GLM; g ∈ (lb, 0))
    plain:       g = −exp(A_log[h]) · softplus(f + dt_bias)        (Kimi-Linear; softplus threshold 20)
    """
    x = f_bthk.astype(jnp.float32) + dt_bias_hk.astype(jnp.float32)
    a_h1 = jnp.exp(A_log_h.astype(jnp.float32))[:, None]
    if form == "lower_bound":
        return lower_bound * jax.nn.sigmoid(a_h1 * x)
    if form == "plain":
        softplus = jnp.where(x > 20.0, x, jnp.log1p(jnp.exp(jnp.minimum(x, 20.0))))
        return -a_h1 * softplus
    raise ValueError(f"unknown KDA gate form {form!r}")


def l2norm(x, eps: float = 1e-6):
    """x / sqrt(Σx² + eps) over the last axis, float32 (eps inside the sqrt, as fla does)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def causal_conv(x_btp, w_kp, tail_bkp=None):
    """Causal depthwise conv, float32 accumulate. Tap K−1 multiplies the current token.

    x `[B, T, P]`, w `[K, P]`, tail `[B, K−1, P]` (the previous K−1 inputs; zeros at a sequence start).
    Returns (out `[B, T, P]` float32, new tail `[B, K−1, P]` in x.dtype).
    """
    K = w_kp.shape[0]
    B, T, P = x_btp.shape
    if tail_bkp is None:
        tail_bkp = jnp.zeros((B, K - 1, P), x_btp.dtype)
    xx = jnp.concatenate([tail_bkp.astype(x_btp.dtype), x_btp], axis=1)  # [B, T+K-1, P]
    w = w_kp.astype(jnp.float32)
    out = sum(xx[:, j:j + T].astype(jnp.float32) * w[j] for j in range(K))
    return out, xx[:, T:]


# ---------------------------------------------------------------------------------------------------------------
# Additions for the kernels' interface (varlen prefill, slot-addressed decode). The functions above are unchanged.
# ---------------------------------------------------------------------------------------------------------------

def recurrent_varlen(q_1thk, k_1thk, v_1thv, g_1thk, beta_1th, cu_seqlens_n1, initial_state_nhkv=None, scale=None):
    """Token-by-token delta rule over N packed sequences in one `[1, Ttot, ...]` batch.

    `cu_seqlens` `[N+1]` int (0 = cu[0] ≤ cu[1] ≤ … ≤ cu[N] = Ttot; empty sequences allowed). The state restarts from
    `initial_state[n]` (zeros when None) at each sequence start. Returns (o `[1, Ttot, H, dv]` in v.dtype,
    final states `[N, H, dk, dv]` float32; an empty sequence returns its initial state).
    """
    _, T, H, dk = q_1thk.shape
    dv = v_1thv.shape[-1]
    cu = jnp.asarray(cu_seqlens_n1, jnp.int32)
    N = cu.shape[0] - 1
    scale = dk ** -0.5 if scale is None else scale
    S0 = (jnp.zeros((N, H, dk, dv), jnp.float32) if initial_state_nhkv is None
          else initial_state_nhkv.astype(jnp.float32))
    t = jnp.arange(T, dtype=jnp.int32)
    seq_t = jnp.clip(jnp.searchsorted(cu, t, side="right") - 1, 0, max(N - 1, 0))  # sequence of each token
    start_t = t == cu[seq_t]
    last_t = t == cu[seq_t + 1] - 1
    f32 = lambda a: a[0].astype(jnp.float32)
    xs = (f32(q_1thk) * scale, f32(k_1thk), f32(v_1thv), f32(g_1thk), f32(beta_1th), seq_t, start_t, last_t)

    def step(carry, x):
        S_hkv, finals = carry
        q_hk, k_hk, v_hv, g_hk, b_h, n, start, last = x
        S_hkv = jnp.where(start, S0[n], S_hkv)
        S_hkv = S_hkv * jnp.exp(g_hk)[..., None]
        kS_hv = _einsum("hk,hkv->hv", k_hk, S_hkv)
        S_hkv = S_hkv + _einsum("hk,hv->hkv", k_hk, b_h[:, None] * (v_hv - kS_hv))
        o_hv = _einsum("hk,hkv->hv", q_hk, S_hkv)
        finals = jnp.where(last, finals.at[n].set(S_hkv), finals)
        return (S_hkv, finals), o_hv

    init = (jnp.zeros((H, dk, dv), jnp.float32), S0)
    (_, finals), o_thv = jax.lax.scan(step, init, xs)
    return o_thv[None].astype(v_1thv.dtype), finals


def recurrent_slots(q_bthk, k_bthk, v_bthv, g_bthk, beta_bth, state_pool_shkv, slot_ids_b, scale=None):
    """Decode against a state pool: sequence b uses (and updates) `state_pool[slot_ids[b]]`.

    Returns (o `[B, T, H, dv]`, the updated pool `[S, H, dk, dv]` float32). Slot ids must be distinct.
    """
    S_bhkv = state_pool_shkv[slot_ids_b]
    o, S_bhkv = recurrent(q_bthk, k_bthk, v_bthv, g_bthk, beta_bth, S_bhkv, scale=scale)
    return o, state_pool_shkv.astype(jnp.float32).at[slot_ids_b].set(S_bhkv)


def gated_rmsnorm(o_bthv, gate_bthv, weight_v, eps: float):
    """The KDA output norm: per-head RMSNorm of o over dv, times `weight [dv]`, times sigmoid(gate), float32."""
    o = o_bthv.astype(jnp.float32)
    o = o * jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + eps) * weight_v
    return o * jax.nn.sigmoid(gate_bthv.astype(jnp.float32))


def decode_step(x_in, f_bp, b_logit_bh, gate_logit_bp, conv, A_log_h, dt_bias_p, o_norm_v, pools, slot_ids_b, *,
                gate_form: str, lower_bound: float = -5.0, o_norm_eps: float = 1e-6, scale=None, recurrent_fn=None):
    """One decode token per sequence of a KDA layer, from its projections to what its o_proj takes, against the
    slots `slot_ids [B]` (distinct) of the layer's pools.

    x_in: the q, k, v projections (`[B, H·dk]`, `[B, H·dk]`, `[B, H·dv]`, the activation dtype); f `[B, H·dk]` the
    raw forget projection, b_logit `[B, H]` and gate_logit `[B, H·dv]` the β and output-gate projections (float32);
    conv: the q, k, v conv weights `[K, P]`; A_log `[H]`, dt_bias `[H·dk]`, o_norm `[dv]`; pools: (state
    `[S, H, dk, dv]` float32, q, k, v tails `[S, K−1, P]`). Per sequence: the causal conv + SiLU of q, k, v over its
    tail, q and k L2-normalised, the delta rule on its state with the gate of `gate_form` and β = sigmoid(b_logit),
    then `gated_rmsnorm`. Returns (o `[B, H·dv]` in the activation dtype, (state, q, k, v tails) with the slots'
    rows updated). `recurrent_fn(q, k, v, g, beta, pool, slot_ids, scale)` runs the delta rule (default
    `recurrent_slots`)."""
    q_in, k_in, v_in = x_in
    state, *tails = pools
    H = A_log_h.shape[0]
    B, Pv = v_in.shape
    dk, dv = q_in.shape[1] // H, Pv // H
    act = v_in.dtype

    def branch(x_bp, w_kp, tail_pool, d):
        y, new_tail = causal_conv(x_bp[:, None], w_kp, tail_pool[slot_ids_b])
        return jax.nn.silu(y).astype(act).reshape(B, 1, H, d), tail_pool.at[slot_ids_b].set(new_tail.astype(
            tail_pool.dtype))

    (q, q_tail), (k, k_tail), (v, v_tail) = (branch(x, w, t, d) for x, w, t, d in zip(x_in, conv, tails,
                                                                                       (dk, dk, dv)))
    q, k = l2norm(q).astype(act), l2norm(k).astype(act)
    g = gate(f_bp.reshape(B, 1, H, dk), A_log_h, dt_bias_p.reshape(H, dk), gate_form, lower_bound)
    beta = jax.nn.sigmoid(b_logit_bh.astype(jnp.float32)).reshape(B, 1, H)
    o, state = (recurrent_fn or recurrent_slots)(q, k, v, g, beta, state, slot_ids_b, scale)
    o = gated_rmsnorm(o, gate_logit_bp.reshape(B, 1, H, dv), o_norm_v, o_norm_eps)
    return o.reshape(B, Pv).astype(act), (state, q_tail, k_tail, v_tail)
