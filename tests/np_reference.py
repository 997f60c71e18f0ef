"""Independent float64 NumPy transcription of the kimi_jax model math (SPEC.md sections 3-7).

Purpose
-------
Ground truth for tests of the JAX / Pallas implementation.  This module is written ONLY from
/work/shared/SPEC.md; it deliberately imports nothing from ``kimi_jax`` or ``pallas_kernels``.
Everything is computed in float64, in the most literal (slow, loop-y where that is clearer)
form of the spec.  Inputs of any float dtype are up-cast to float64 on entry.

Conventions
-----------
* Shapes are spelled in variable names: ``x_td`` is ``[T, D]``, ``q_thd`` is ``[T, H, d]``,
  ``s_hkv`` is ``[H, d_k, d_v]`` ...  T tokens, D model width, H heads, d head dim, P = H*d.
* Projection weights are torch-style ``[out, in]``; a linear layer is ``x @ W.T``
  (helper :func:`linear`).
* Weight dictionaries use the checkpoint names of SPEC section 8 without the trailing
  ``.weight`` (e.g. ``weights["q_a_proj"]``); the few exceptions are documented per function.
* Causality: query position ``t`` may see key position ``s`` iff ``s <= t``.

Tie rules (top-k selections)
----------------------------
* Indexer top-k (:func:`indexer_keep_mask`): among equal scores the EARLIER position
  (smaller ``s``) wins.
* Router top-k (:func:`router`) and group top-k: among equal (biased) scores the SMALLER
  expert / group id wins.
Both are implemented with a stable sort of the negated scores.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np

F64 = np.float64


def _f(x) -> np.ndarray:
    """Up-cast to a float64 ndarray (copy only if needed)."""
    return np.asarray(x, dtype=F64)


def linear(x, w_oi) -> np.ndarray:
    """Torch-style linear layer without bias: ``x @ w.T`` with ``w`` of shape ``[out, in]``."""
    return _f(x) @ _f(w_oi).T


# ---------------------------------------------------------------------------------------------
# Elementwise activations and norms
# ---------------------------------------------------------------------------------------------

def sigmoid(x) -> np.ndarray:
    """Numerically stable logistic function 1 / (1 + exp(-x)) in float64."""
    x = _f(x)
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def silu(x) -> np.ndarray:
    """SiLU / swish: x * sigmoid(x)."""
    x = _f(x)
    return x * sigmoid(x)


def softplus(x, threshold: float = 20.0) -> np.ndarray:
    """torch.nn.functional.softplus with beta=1: ``x`` where ``x > threshold`` else ``log1p(exp(x))``."""
    x = _f(x)
    return np.where(x > threshold, x, np.log1p(np.exp(np.minimum(x, threshold))))


def rmsnorm(x, weight=None, eps: float = 1e-5) -> np.ndarray:
    """RMSNorm over the last axis: ``x * rsqrt(mean(x^2) + eps) * weight`` (weight optional)."""
    x = _f(x)
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    if weight is not None:
        y = y * _f(weight)
    return y


def layernorm(x, weight=None, bias=None, eps: float = 1e-5) -> np.ndarray:
    """LayerNorm over the last axis (biased variance, like torch): ``(x-mean)/sqrt(var+eps)*w + b``."""
    x = _f(x)
    mu = np.mean(x, axis=-1, keepdims=True)
    var = np.mean((x - mu) ** 2, axis=-1, keepdims=True)
    y = (x - mu) / np.sqrt(var + eps)
    if weight is not None:
        y = y * _f(weight)
    if bias is not None:
        y = y + _f(bias)
    return y


def l2norm(x, eps: float = 1e-6) -> np.ndarray:
    """KDA q/k normalisation over the last axis, eps INSIDE the sqrt: ``x / sqrt(sum(x^2) + eps)``."""
    x = _f(x)
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def situ(g, u, beta: float = 4.0, linear_beta: float = 25.0) -> np.ndarray:
    """SiTU gated activation (K3, SPEC §7).

    ``[beta * tanh(g / beta) * sigmoid(g)] * [linear_beta * tanh(u / linear_beta)]``
    with g the gate branch (w1 / gate_proj) and u the up branch (w3 / up_proj).
    """
    g, u = _f(g), _f(u)
    return (beta * np.tanh(g / beta) * sigmoid(g)) * (linear_beta * np.tanh(u / linear_beta))


def swiglu(g, u) -> np.ndarray:
    """SwiGLU: ``silu(g) * u`` (Kimi-Linear, DeepSeek)."""
    return silu(g) * _f(u)


def clamped_swiglu(g, u, limit: float = 10.0) -> np.ndarray:
    """GLM clamped SwiGLU: ``silu(min(g, limit)) * clip(u, -limit, limit)``."""
    g, u = _f(g), _f(u)
    return silu(np.minimum(g, limit)) * np.clip(u, -limit, limit)


def activation(name: str, g, u, situ_beta: float = 4.0, situ_linear_beta: float = 25.0):
    """Dispatch a gated activation by name: ``"situ"``, ``"swiglu"``/``"silu"``, ``"clamped_swiglu"``."""
    if name == "situ":
        return situ(g, u, situ_beta, situ_linear_beta)
    if name in ("swiglu", "silu"):
        return swiglu(g, u)
    if name == "clamped_swiglu":
        return clamped_swiglu(g, u)
    raise ValueError(f"unknown activation {name!r}")


# ---------------------------------------------------------------------------------------------
# SPEC §3: Block Attention Residuals
# ---------------------------------------------------------------------------------------------

def attn_res_mix(sources_td: Sequence[np.ndarray], proj_weight, norm_weight, eps: float = 1e-5):
    """AttnRes softmax mix over source summaries (SPEC §3 ``mix``).

    Args:
      sources_td: list of S arrays, each ``[T, D]`` (or any ``[..., D]``, all the same shape).
      proj_weight: ``[D]`` or ``[1, D]`` (the ``*_res_proj`` Linear(D, 1) weight).
      norm_weight: ``[D]`` (the ``*_res_norm`` RMSNorm weight).
      eps: eps of the parameter-free RMS normalisation of the keys.

    Computation::

      v = stack(sources)                        # [S, T, D]
      k = v * rsqrt(mean(v^2, -1) + eps)        # RMS-normalised WITHOUT the norm weight
      w = norm_weight * proj_weight             # [D] pseudo-query
      p = softmax(sum(k * w, -1), over S)       # [S, T]
      h = sum_s p_s * v_s                       # mixes the UN-normalised sources

    Returns ``h`` with the shape of one source.
    """
    v_std = np.stack([_f(s) for s in sources_td], axis=0)
    k_std = rmsnorm(v_std, None, eps)
    w_d = _f(norm_weight).reshape(-1) * _f(proj_weight).reshape(-1)
    logits_st = np.sum(k_std * w_d, axis=-1)
    logits_st = logits_st - np.max(logits_st, axis=0, keepdims=True)
    p_st = np.exp(logits_st)
    p_st = p_st / np.sum(p_st, axis=0, keepdims=True)
    return np.sum(p_st[..., None] * v_std, axis=0)


def attn_res_forward(
    embed_td,
    attn: Callable[[int, np.ndarray], np.ndarray],
    ffn: Callable[[int, np.ndarray], np.ndarray],
    params: dict,
    block_size: Optional[int],
    eps: float = 1e-5,
    trace: Optional[list] = None,
) -> np.ndarray:
    """Run the decoder residual stream of SPEC §3 with caller-supplied sub-layers.

    Args:
      embed_td: ``[T, D]`` token embeddings.
      attn: ``attn(L, normed_h_td) -> a_td``: the attention (KDA or MLA) of layer L, given the
        ALREADY ``input_layernorm``-ed hidden state.
      ffn: ``ffn(L, normed_h_td) -> f_td``: the FFN of layer L, given the already
        ``post_attention_layernorm``-ed hidden state.
      params: dict with
        ``"layers"``: list (one per decoder layer) of dicts with ``"input_layernorm"``,
        ``"post_attention_layernorm"`` (``[D]`` RMSNorm weights) and, when ``block_size`` is not
        None, ``"self_attention_res_proj"``, ``"self_attention_res_norm"``, ``"mlp_res_proj"``,
        ``"mlp_res_norm"``;
        ``"output_attn_res_proj"``, ``"output_attn_res_norm"`` (AttnRes only);
        ``"norm"``: final RMSNorm weight ``[D]`` (optional; if absent the final norm is skipped).
      block_size: AttnRes block size B (12 for K3), or ``None`` for a plain pre-norm residual
        stream (``h = h + attn(norm(h)); h = h + ffn(norm(h))``).
      eps: eps used by every RMSNorm here and by the AttnRes key normalisation.
      trace: optional list; if given, ``(L, "attn" | "mlp" | "out", n_sources)`` is appended for
        every AttnRes mix (number of sources mixed), for structural tests.

    Returns the final hidden state ``[T, D]`` after the output mix and final ``norm``
    (i.e. the ``lm_head`` input).

    The AttnRes loop, literally as in SPEC §3::

      prefix = embed; blocks = []
      for L:
        h = prefix if not blocks else mix(blocks + [prefix], self_attention_res_*)
        if L % B == 0: blocks.append(prefix); prefix = None
        a = attn(input_layernorm(h)); prefix = a if prefix is None else prefix + a
        h = mix(blocks + [prefix], mlp_res_*)
        prefix = prefix + ffn(post_attention_layernorm(h))
      h = mix(blocks + [prefix], output_attn_res_*)
    """
    layers = params["layers"]
    if block_size is None:
        h = _f(embed_td)
        for L, lp in enumerate(layers):
            h = h + _f(attn(L, rmsnorm(h, lp["input_layernorm"], eps)))
            h = h + _f(ffn(L, rmsnorm(h, lp["post_attention_layernorm"], eps)))
    else:
        B = int(block_size)
        prefix = _f(embed_td)
        blocks: list = []
        for L, lp in enumerate(layers):
            if not blocks:
                h = prefix
            else:
                if trace is not None:
                    trace.append((L, "attn", len(blocks) + 1))
                h = attn_res_mix(blocks + [prefix], lp["self_attention_res_proj"],
                                 lp["self_attention_res_norm"], eps)
            if L % B == 0:
                blocks.append(prefix)
                prefix = None
            a = _f(attn(L, rmsnorm(h, lp["input_layernorm"], eps)))
            prefix = a if prefix is None else prefix + a
            if trace is not None:
                trace.append((L, "mlp", len(blocks) + 1))
            h = attn_res_mix(blocks + [prefix], lp["mlp_res_proj"], lp["mlp_res_norm"], eps)
            prefix = prefix + _f(ffn(L, rmsnorm(h, lp["post_attention_layernorm"], eps)))
        if trace is not None:
            trace.append((len(layers), "out", len(blocks) + 1))
        h = attn_res_mix(blocks + [prefix], params["output_attn_res_proj"],
                         params["output_attn_res_norm"], eps)
    if params.get("norm") is not None:
        h = rmsnorm(h, params["norm"], eps)
    return h


# ---------------------------------------------------------------------------------------------
# SPEC §4: KDA
# ---------------------------------------------------------------------------------------------

def kda_a_log(a_log, num_heads: int) -> np.ndarray:
    """Normalise a stored ``A_log`` to ``[H]``.

    Accepts ``[H]``, Kimi-Linear's ``[1, 1, H, 1]`` (any shape with exactly H elements), and
    K3's zero-padded 1-D ``[N > H]`` (sliced to the first H).  Anything else raises.
    """
    a = _f(a_log)
    if a.size == num_heads:
        return a.reshape(num_heads)
    if a.ndim == 1 and a.shape[0] > num_heads:
        return a[:num_heads].copy()
    raise ValueError(f"A_log shape {a.shape} not understood for {num_heads} heads")


def kda_gate(f_tp, A_log_h, dt_bias_p, form: str, lower_bound: float = -5.0,
             head_dim: int = 128) -> np.ndarray:
    """KDA per-channel log-decay g (SPEC §4).

    Args:
      f_tp: ``[T, P]`` low-rank forget-gate projection ``(x @ Wfa.T) @ Wfb.T``.
      A_log_h: ``[H]`` (any shape with H elements, see :func:`kda_a_log`), H = P // head_dim.
      dt_bias_p: ``[P]`` (any shape with P elements).
      form: ``"lower_bound"`` (alias ``"safe"``; K3 / GLM):
              ``g = lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias))``
            ``"plain"`` (Kimi-Linear):
              ``g = -exp(A_log[h]) * softplus(f + dt_bias)``   (softplus threshold 20)
      lower_bound: only for the lower-bound form (K3: -5.0).
      head_dim: d.

    Returns ``g_thd`` ``[T, H, d]`` (all entries <= 0).
    """
    f_tp = _f(f_tp)
    T, P = f_tp.shape
    H = P // head_dim
    if H * head_dim != P:
        raise ValueError("P must be a multiple of head_dim")
    a_h = kda_a_log(A_log_h, H)
    z_thd = (f_tp + _f(dt_bias_p).reshape(P)).reshape(T, H, head_dim)
    A_h11 = np.exp(a_h)[None, :, None]
    if form in ("lower_bound", "safe"):
        return lower_bound * sigmoid(A_h11 * z_thd)
    if form == "plain":
        return -A_h11 * softplus(z_thd, 20.0)
    raise ValueError(f"unknown KDA gate form {form!r}")


def causal_depthwise_conv(x_tp, w_pk, tail_kp=None):
    """Causal depthwise 1-D convolution (KDA short conv), no bias, no activation.

    ``out[t, p] = sum_{j=0}^{K-1} w[p, j] * x[t - K + 1 + j, p]``; tap ``K-1`` multiplies the
    current token.  Positions before the sequence start are zeros, unless ``tail_kp`` (the
    previous ``K-1`` inputs, oldest first, shape ``[K-1, P]``) is given.

    Args:
      x_tp: ``[T, P]``.
      w_pk: ``[P, K]`` or torch's ``[P, 1, K]``.
      tail_kp: optional ``[K-1, P]`` history.

    Returns ``(out_tp, new_tail_kp)`` where ``new_tail_kp`` is the last ``K-1`` inputs (history
    included), so chaining calls equals one call over the concatenated sequence.
    """
    x_tp = _f(x_tp)
    w = _f(w_pk)
    P = x_tp.shape[1]
    w_pk = w.reshape(P, -1)
    K = w_pk.shape[1]
    if tail_kp is None:
        tail_kp = np.zeros((K - 1, P), F64)
    xx = np.concatenate([_f(tail_kp).reshape(K - 1, P), x_tp], axis=0)  # [K-1+T, P]
    T = x_tp.shape[0]
    out = np.zeros((T, P), F64)
    for t in range(T):
        # xx[t + j] corresponds to x[t - K + 1 + j]
        out[t] = np.sum(w_pk.T * xx[t:t + K], axis=0)
    new_tail = xx[xx.shape[0] - (K - 1):].copy()
    return out, new_tail


def kda_recurrence(q_thd, k_thd, v_thd, g_thd, beta_th, initial_state_hkv=None):
    """Per-token KDA gated delta rule (SPEC §4), float64.

    Inputs are used as given: q and k must ALREADY be l2-normalised (:func:`l2norm`) and q
    already scaled by ``d**-0.5``.

    Args:
      q_thd, k_thd: ``[T, H, d_k]``; v_thd: ``[T, H, d_v]``; g_thd: ``[T, H, d_k]`` log-decay;
      beta_th: ``[T, H]``; initial_state_hkv: ``[H, d_k, d_v]`` or None (zeros).

    Per head h and token t (S is ``[d_k, d_v]``)::

      S = S * exp(g_t)[:, None]            # decay along the key axis
      S = S + beta_t * k_t (x) (v_t - S^T k_t)   # delta rule using the decayed S
      o_t = S^T q_t                        # read AFTER the update

    Returns ``(o_thv [T, H, d_v], final_state_hkv [H, d_k, d_v])``.
    """
    q, k, v, g, beta = (_f(a) for a in (q_thd, k_thd, v_thd, g_thd, beta_th))
    T, H, dk = q.shape
    dv = v.shape[-1]
    S = np.zeros((H, dk, dv), F64) if initial_state_hkv is None else _f(initial_state_hkv).copy()
    o = np.zeros((T, H, dv), F64)
    for t in range(T):
        S = S * np.exp(g[t])[:, :, None]
        pred_hv = np.einsum("hk,hkv->hv", k[t], S)                    # S^T k
        S = S + beta[t][:, None, None] * k[t][:, :, None] * (v[t] - pred_hv)[:, None, :]
        o[t] = np.einsum("hk,hkv->hv", q[t], S)                       # S^T q
    return o, S


def kda_chunked(q_thd, k_thd, v_thd, g_thd, beta_th, initial_state_hkv=None, chunk: int = 64):
    """Chunked KDA (SPEC §4 'Chunked prefill' formulas), float64, exact pairwise exponents.

    Provided to check the chunk algebra of the spec against :func:`kda_recurrence`; all
    exponents used are ``<= 0`` (differences Γ_r - Γ_c with c <= r, and Γ itself).
    Same inputs/outputs as :func:`kda_recurrence`.
    """
    q, k, v, g, beta = (_f(a) for a in (q_thd, k_thd, v_thd, g_thd, beta_th))
    T, H, dk = q.shape
    dv = v.shape[-1]
    S = np.zeros((H, dk, dv), F64) if initial_state_hkv is None else _f(initial_state_hkv).copy()
    o = np.zeros((T, H, dv), F64)
    for c0 in range(0, T, chunk):
        c1 = min(T, c0 + chunk)
        n = c1 - c0
        for h in range(H):
            qc, kc, vc = q[c0:c1, h], k[c0:c1, h], v[c0:c1, h]
            bc = beta[c0:c1, h]
            G = np.cumsum(g[c0:c1, h], axis=0)                          # [n, dk] inclusive
            D = G[:, None, :] - G[None, :, :]                           # [r, c, dk] Γ_r - Γ_c
            causal = np.arange(n)[:, None] >= np.arange(n)[None, :]
            strict = np.arange(n)[:, None] > np.arange(n)[None, :]
            E = np.exp(np.where(causal[:, :, None], D, -np.inf))       # 0 above the diagonal
            Akk = bc[:, None] * np.einsum("rd,cd,rcd->rc", kc, kc, E) * strict
            Aqk = np.einsum("rd,cd,rcd->rc", qc, kc, E) * causal
            Tm = np.linalg.inv(np.eye(n) + Akk)
            W = Tm @ (bc[:, None] * kc * np.exp(G))
            U = Tm @ (bc[:, None] * vc)
            Vn = U - W @ S[h]
            o[c0:c1, h] = (qc * np.exp(G)) @ S[h] + Aqk @ Vn
            S[h] = np.exp(G[-1])[:, None] * S[h] + (kc * np.exp(G[-1][None, :] - G)).T @ Vn
    return o, S


def kda_layer(x_td, weights: dict, cfg: dict, state: Optional[dict] = None):
    """Full KDA layer (SPEC §4) on ``x_td`` (already ``input_layernorm``-ed).

    weights (torch ``[out, in]``; P = H*d):
      ``q_proj``, ``k_proj``, ``v_proj``: ``[P, D]``;
      ``q_conv1d``, ``k_conv1d``, ``v_conv1d``: ``[P, 1, K]`` or ``[P, K]``;
      ``f_a_proj``: ``[r_f, D]`` (r_f = d), ``f_b_proj``: ``[P, r_f]``;
      ``b_proj``: ``[H, D]``; ``A_log``: see :func:`kda_a_log`; ``dt_bias``: ``[P]``;
      ``o_norm``: ``[d]``; output gate: ``g_proj`` ``[P, D]`` (K3 full-rank) OR
      ``g_a_proj`` ``[r_g, D]`` + ``g_b_proj`` ``[P, r_g]`` (Kimi-Linear low-rank);
      ``o_proj``: ``[D, P]``.
    cfg:
      ``num_heads`` H, ``head_dim`` d, ``gate_form`` (``"lower_bound"`` | ``"plain"``,
      default ``"lower_bound"``), ``gate_lower_bound`` (default -5.0), ``norm_eps`` for the
      per-head output RMSNorm (default 1e-5), ``l2_eps`` (default 1e-6).
    state (optional, as returned): ``{"conv_q", "conv_k", "conv_v"}`` tails ``[K-1, P]`` and
      ``"S"`` ``[H, d, d]``.  ``None`` means zeros (sequence start).

    Steps::

      q,k,v = silu(conv(x @ W.T))           (per projection, with its own conv + tail)
      f     = (x @ Wfa.T) @ Wfb.T;  g = kda_gate(f, ...)
      beta  = sigmoid(x @ Wb.T)
      q,k   = l2norm(q), l2norm(k) per head; q *= d^-0.5
      o, S  = kda_recurrence(q, k, v, g, beta, S)
      o     = rmsnorm_per_head(o, eps) * o_norm * sigmoid(gate)
      out   = o @ Wo.T

    Returns ``(out_td, new_state)``; running token by token with the carried state equals running
    the whole sequence.
    """
    x = _f(x_td)
    T = x.shape[0]
    H, d = int(cfg["num_heads"]), int(cfg["head_dim"])
    P = H * d
    state = state or {}
    new_state = {}
    proj = {}
    for name in ("q", "k", "v"):
        y = linear(x, weights[f"{name}_proj"])
        y, new_state[f"conv_{name}"] = causal_depthwise_conv(y, weights[f"{name}_conv1d"],
                                                             state.get(f"conv_{name}"))
        proj[name] = silu(y).reshape(T, H, d)
    f = linear(linear(x, weights["f_a_proj"]), weights["f_b_proj"])
    g = kda_gate(f, weights["A_log"], weights["dt_bias"], cfg.get("gate_form", "lower_bound"),
                 cfg.get("gate_lower_bound", -5.0), d)
    beta = sigmoid(linear(x, weights["b_proj"]))
    l2_eps = cfg.get("l2_eps", 1e-6)
    q = l2norm(proj["q"], l2_eps) * d ** -0.5
    k = l2norm(proj["k"], l2_eps)
    o, new_state["S"] = kda_recurrence(q, k, proj["v"], g, beta, state.get("S"))
    if "g_proj" in weights:
        gate = linear(x, weights["g_proj"])
    else:
        gate = linear(linear(x, weights["g_a_proj"]), weights["g_b_proj"])
    o = rmsnorm(o, weights["o_norm"], cfg.get("norm_eps", 1e-5)) * sigmoid(gate.reshape(T, H, d))
    out = linear(o.reshape(T, P), weights["o_proj"])
    return out, new_state


# ---------------------------------------------------------------------------------------------
# SPEC §5: MLA
# ---------------------------------------------------------------------------------------------

def _mla_dims(cfg):
    return (int(cfg["num_heads"]), int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"]),
            int(cfg["v_head_dim"]), int(cfg["kv_lora_rank"]))


def mla_q_latent(x_td, weights: dict, cfg: dict):
    """MLA query latent ``c_q = rmsnorm(x @ Wqa.T, q_a_layernorm, q_a_eps)`` ``[T, r_q]``;
    ``None`` when there is no q LoRA (no ``q_a_proj`` in weights)."""
    if "q_a_proj" not in weights:
        return None
    return rmsnorm(linear(x_td, weights["q_a_proj"]), weights["q_a_layernorm"],
                   cfg.get("q_a_eps", 1e-5))


def _mla_common(x_td, weights, cfg, rope):
    """Shared part of both MLA forms: q ``[T,H,n+r]`` split, latent ``[T,c]``, k_rope ``[T,r]``."""
    x = _f(x_td)
    T = x.shape[0]
    H, n, r, dv, c = _mla_dims(cfg)
    cq = mla_q_latent(x, weights, cfg)
    q = linear(cq, weights["q_b_proj"]) if cq is not None else linear(x, weights["q_proj"])
    q = q.reshape(T, H, n + r)
    q_nope, q_rope = q[..., :n], q[..., n:]
    ckv = linear(x, weights["kv_a_proj_with_mqa"])                        # [T, c + r]
    lat = rmsnorm(ckv[:, :c], weights["kv_a_layernorm"], cfg.get("kv_a_eps", 1e-5))
    k_rope = ckv[:, c:]
    if rope is not None:
        q_rope, k_rope = rope(q_rope, k_rope)
        q_rope, k_rope = _f(q_rope), _f(k_rope)
    return x, q_nope, q_rope, lat, k_rope


def _mla_mask(T, keep_mask_ts):
    mask = np.tril(np.ones((T, T), dtype=bool))
    if keep_mask_ts is not None:
        mask = mask & np.asarray(keep_mask_ts, dtype=bool)
    return mask


def _softmax_masked(logits, mask):
    logits = np.where(mask, logits, -np.inf)
    m = np.max(logits, axis=-1, keepdims=True)
    p = np.exp(logits - m)
    return p / np.sum(p, axis=-1, keepdims=True)


def _mla_finish(x, attn_thv, weights, cfg):
    T, H, dv = attn_thv.shape
    attn = attn_thv.reshape(T, H * dv)
    if cfg.get("use_output_gate", "g_proj" in weights):
        attn = attn * sigmoid(linear(x, weights["g_proj"]))
    return linear(attn, weights["o_proj"])


def mla_attention(x_td, weights: dict, cfg: dict, rope=None, keep_mask_ts=None) -> np.ndarray:
    """Naive (materialised K/V) MLA of SPEC §5, causal, float64.

    Args:
      x_td: ``[T, D]`` (already ``input_layernorm``-ed).
      weights: ``q_a_proj`` ``[r_q, D]`` + ``q_a_layernorm`` ``[r_q]`` + ``q_b_proj``
        ``[H*(n+r), r_q]`` (q LoRA), OR ``q_proj`` ``[H*(n+r), D]``;
        ``kv_a_proj_with_mqa`` ``[c+r, D]``; ``kv_a_layernorm`` ``[c]``;
        ``kv_b_proj`` ``[H*(n+dv), c]`` (per head rows ``[k_nope n | v dv]``);
        ``o_proj`` ``[D, H*dv]``; optional ``g_proj`` ``[H*dv, D]`` (output gate).
      cfg: ``num_heads`` H, ``qk_nope_head_dim`` n, ``qk_rope_head_dim`` r, ``v_head_dim`` dv,
        ``kv_lora_rank`` c; optional ``softmax_scale`` (default ``(n+r)**-0.5``),
        ``q_a_eps`` / ``kv_a_eps`` (default 1e-5), ``use_output_gate`` (default: g_proj present).
      rope: ``None`` (NoPE, K3/Kimi: the r "rope" dims pass through unrotated) or a callable
        ``rope(q_rope_thr, k_rope_tr) -> (q_rope_thr, k_rope_tr)`` applying positions 0..T-1.
      keep_mask_ts: optional bool ``[T, T]`` (e.g. from :func:`indexer_keep_mask`), AND-ed with
        the causal mask ``s <= t``.

    ``k = [k_nope | k_rope (shared by all heads)]``,
    ``attn = softmax(q.k * scale + mask) v``; ``attn *= sigmoid(x @ Wg.T)`` if gated;
    ``out = attn @ Wo.T``.  Returns ``[T, D]``.
    """
    x, q_nope, q_rope, lat, k_rope = _mla_common(x_td, weights, cfg, rope)
    T = x.shape[0]
    H, n, r, dv, c = _mla_dims(cfg)
    kv = linear(lat, weights["kv_b_proj"]).reshape(T, H, n + dv)
    k_nope, v = kv[..., :n], kv[..., n:]
    k = np.concatenate([k_nope, np.broadcast_to(k_rope[:, None, :], (T, H, r))], axis=-1)
    q = np.concatenate([q_nope, q_rope], axis=-1)
    scale = cfg.get("softmax_scale") or (n + r) ** -0.5
    logits_hts = np.einsum("thd,shd->hts", q, k) * scale
    p = _softmax_masked(logits_hts, _mla_mask(T, keep_mask_ts)[None])
    attn_thv = np.einsum("hts,shv->thv", p, v)
    return _mla_finish(x, attn_thv, weights, cfg)


def mla_absorbed(x_td, weights: dict, cfg: dict, rope=None, keep_mask_ts=None) -> np.ndarray:
    """Absorbed MLA (SPEC §5 decode form); same arguments and result as :func:`mla_attention`.

    ``kv_b_proj`` is split per head into ``W_UK [H, n, c]`` and ``W_UV [H, dv, c]``;
    ``q_lat = q_nope @ W_UK`` (c-dim); attention is MQA over the cached ``[lat | k_rope]``
    (c+r dims) keys and ``lat`` (c dims) values with the same scale; the per-head latent output
    is mapped through ``W_UV`` before the gate and ``o_proj``.
    """
    x, q_nope, q_rope, lat, k_rope = _mla_common(x_td, weights, cfg, rope)
    T = x.shape[0]
    H, n, r, dv, c = _mla_dims(cfg)
    wkvb = _f(weights["kv_b_proj"]).reshape(H, n + dv, c)
    W_UK, W_UV = wkvb[:, :n, :], wkvb[:, n:, :]
    q_lat = np.einsum("thn,hnc->thc", q_nope, W_UK)
    q_full = np.concatenate([q_lat, q_rope], axis=-1)                      # [T, H, c + r]
    kv_cache = np.concatenate([lat, k_rope], axis=-1)                      # [T, c + r]
    scale = cfg.get("softmax_scale") or (n + r) ** -0.5
    logits_hts = np.einsum("thd,sd->hts", q_full, kv_cache) * scale
    p = _softmax_masked(logits_hts, _mla_mask(T, keep_mask_ts)[None])
    out_lat_thc = np.einsum("hts,sc->thc", p, lat)
    attn_thv = np.einsum("thc,hvc->thv", out_lat_thc, W_UV)
    return _mla_finish(x, attn_thv, weights, cfg)


# ---------------------------------------------------------------------------------------------
# SPEC §6: DSA lightning indexer
# ---------------------------------------------------------------------------------------------

def indexer_scores(x_td, cq_tr, weights: dict, cfg: dict, rope=None) -> np.ndarray:
    """Lightning-indexer scores (SPEC §6, K3.1 form), float64.

    Args:
      x_td: ``[T, D]`` (the MLA layer input).
      cq_tr: ``[T, r_q]`` MLA query latent (after ``q_a_layernorm``; see :func:`mla_q_latent`).
      weights: ``wq_b`` ``[Hi*di, r_q]``, ``wk`` ``[di, D]``, ``k_norm_weight`` ``[di]``,
        ``k_norm_bias`` ``[di]`` (LayerNorm), ``weights_proj`` ``[Hi, D]``.
      cfg: ``index_n_heads`` Hi, ``index_head_dim`` di, ``index_norm_eps`` (default 1e-5).
      rope: optional callable ``rope(qi_thd, ki_td) -> (qi, ki)`` (DeepSeek-V3.2); None = K3.1.

    ``score[t, s] = sum_h w[t, h] * Hi^-0.5 * di^-0.5 * relu(qi[t, h] . ki[s])`` for ``s <= t``,
    ``-inf`` for ``s > t``.  Returns ``[T, T]``.
    """
    x = _f(x_td)
    T = x.shape[0]
    Hi, di = int(cfg["index_n_heads"]), int(cfg["index_head_dim"])
    qi = linear(cq_tr, weights["wq_b"]).reshape(T, Hi, di)
    ki = layernorm(linear(x, weights["wk"]), weights["k_norm_weight"], weights["k_norm_bias"],
                   cfg.get("index_norm_eps", 1e-5))
    if rope is not None:
        qi, ki = rope(qi, ki)
        qi, ki = _f(qi), _f(ki)
    w_th = linear(x, weights["weights_proj"])
    dots_ths = np.maximum(np.einsum("thd,sd->ths", qi, ki), 0.0)
    score = np.einsum("th,ths->ts", w_th, dots_ths) * (Hi ** -0.5) * (di ** -0.5)
    causal = np.tril(np.ones((T, T), dtype=bool))
    return np.where(causal, score, -np.inf)


def indexer_keep_mask(score_ts, topk: int) -> np.ndarray:
    """Top-k key selection per query row among causal positions ``s <= t``.

    Row t keeps all of ``0..t`` when ``t + 1 <= topk``, otherwise the ``topk`` highest scores.
    Tie rule: among equal scores the EARLIER position (smaller s) wins (stable sort).
    Returns bool ``[T, T]`` (always False above the diagonal).
    """
    score = _f(score_ts)
    T = score.shape[0]
    keep = np.zeros((T, T), dtype=bool)
    for t in range(T):
        if t + 1 <= topk:
            keep[t, :t + 1] = True
        else:
            order = np.argsort(-score[t, :t + 1], kind="stable")
            keep[t, order[:topk]] = True
    return keep


def mla_with_indexer(x_td, weights: dict, cfg: dict, rope=None) -> np.ndarray:
    """Convenience: K3.1 MLA+DSA layer = indexer scores -> top-k keep mask -> masked MLA.

    ``weights["indexer"]`` holds the indexer weights (see :func:`indexer_scores`), ``cfg`` holds
    both MLA and indexer keys plus ``index_topk``.
    """
    cq = mla_q_latent(x_td, weights, cfg)
    score = indexer_scores(x_td, cq, weights["indexer"], cfg)
    keep = indexer_keep_mask(score, int(cfg["index_topk"]))
    return mla_attention(x_td, weights, cfg, rope=rope, keep_mask_ts=keep)


# ---------------------------------------------------------------------------------------------
# SPEC §7: router, MoE
# ---------------------------------------------------------------------------------------------

def router(x_td, gate_w, bias=None, top_k: int = 8, num_groups: int = 1, topk_groups: int = 1,
           renormalize: bool = True, scaling: float = 1.0):
    """Sigmoid ``noaux_tc`` router (SPEC §7), float64.

    ``s = sigmoid(x @ gate_w.T)`` ``[T, E]``; selection uses ``s + bias``.  With groups
    (``num_groups > 1``), each group's score is the sum of its top-2 biased scores, the best
    ``topk_groups`` groups are kept and the others' experts are masked with ``-inf``.  Then
    top-k experts by biased score.  Weights are the UNBIASED ``s`` of the chosen experts,
    divided by ``(sum + 1e-20)`` if ``renormalize``, then times ``scaling``.

    Returns ``(weights [T, k], idx [T, k])`` in selection order (descending biased score;
    ties -> smaller expert id first).  Compare as sets or via :func:`router_dense`.
    """
    x = _f(x_td)
    s_te = sigmoid(x @ _f(gate_w).T)
    T, E = s_te.shape
    b = np.zeros(E, F64) if bias is None else _f(bias).reshape(E)
    choice = s_te + b
    if num_groups > 1:
        gsz = E // num_groups
        grp = choice.reshape(T, num_groups, gsz)
        top2 = -np.sort(-grp, axis=-1)[..., :2]
        gscore = top2.sum(-1)                                            # [T, G]
        gorder = np.argsort(-gscore, axis=-1, kind="stable")[:, :topk_groups]
        gmask = np.zeros((T, num_groups), dtype=bool)
        np.put_along_axis(gmask, gorder, True, axis=-1)
        choice = np.where(np.repeat(gmask, gsz, axis=-1), choice, -np.inf)
    idx = np.argsort(-choice, axis=-1, kind="stable")[:, :top_k]
    w = np.take_along_axis(s_te, idx, axis=-1)
    if renormalize:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    return w * scaling, idx


def router_dense(x_td, gate_w, bias=None, top_k: int = 8, num_groups: int = 1,
                 topk_groups: int = 1, renormalize: bool = True, scaling: float = 1.0):
    """Same as :func:`router` but returns a dense ``[T, E]`` weight matrix (0 for unchosen)."""
    w, idx = router(x_td, gate_w, bias, top_k, num_groups, topk_groups, renormalize, scaling)
    E = _f(gate_w).shape[0]
    dense = np.zeros((w.shape[0], E), F64)
    np.put_along_axis(dense, idx, w, axis=-1)
    return dense


def mlp(x_td, gate_proj, up_proj, down_proj, act: str = "situ", situ_beta: float = 4.0,
        situ_linear_beta: float = 25.0) -> np.ndarray:
    """Gated MLP: ``down(act(x @ gate.T, x @ up.T))``; gate/up ``[I, D]``, down ``[D, I]``.

    Used for the dense layer-0 FFN, the shared experts and each routed expert
    (w1 = gate, w3 = up, w2 = down).
    """
    g = linear(x_td, gate_proj)
    u = linear(x_td, up_proj)
    return linear(activation(act, g, u, situ_beta, situ_linear_beta), down_proj)


def _experts_list(experts):
    """Accept a list of ``{"w1","w2","w3"}`` dicts or a dict of stacked ``[E, ...]`` arrays."""
    if isinstance(experts, dict):
        E = np.asarray(experts["w1"]).shape[0]
        return [{k: experts[k][e] for k in ("w1", "w2", "w3")} for e in range(E)]
    return list(experts)


def moe(x_td, weights: dict, cfg: dict) -> np.ndarray:
    """MoE FFN (SPEC §7): standard or latent, plus optional shared experts. float64.

    weights:
      ``gate`` ``[E, D]`` router weight; ``e_score_correction_bias`` ``[E]`` (optional);
      ``experts``: list of E dicts ``{"w1": [I, Dx], "w3": [I, Dx], "w2": [Dx, I]}`` or a dict of
        stacked arrays ``{"w1": [E, I, Dx], ...}`` (Dx = D standard, L latent);
      ``shared_experts`` (optional): ``{"gate_proj", "up_proj": [Is, D], "down_proj": [D, Is]}``
        with Is = moe_intermediate_size * num_shared_experts;
      latent only: ``routed_expert_down_proj`` ``[L, D]``, ``routed_expert_up_proj`` ``[D, L]``,
        ``routed_expert_norm`` ``[L]`` (used when ``latent_moe_use_norm``, default True).
    cfg:
      ``top_k``, ``num_groups`` (1), ``topk_groups`` (1), ``renormalize`` (True),
      ``routed_scaling_factor`` (1.0), ``activation`` (``"situ"``/``"swiglu"``),
      ``situ_beta`` (4.0), ``situ_linear_beta`` (25.0), ``latent`` (default: down proj present),
      ``latent_moe_use_norm`` (True), ``norm_eps`` (1e-5).

    Standard: ``out = sum_k w_k * expert_k(x) + shared(x)``.
    Latent:   ``xl = x @ Wdown.T; y = sum_k w_k * expert_k(xl); y = rmsnorm(y, routed_expert_norm);
               out = y @ Wup.T + shared(x)``.  The router always reads the full-width x.
    """
    x = _f(x_td)
    act = cfg.get("activation", "situ")
    sb, slb = cfg.get("situ_beta", 4.0), cfg.get("situ_linear_beta", 25.0)
    dense_te = router_dense(x, weights["gate"], weights.get("e_score_correction_bias"),
                            int(cfg["top_k"]), int(cfg.get("num_groups", 1)),
                            int(cfg.get("topk_groups", 1)), bool(cfg.get("renormalize", True)),
                            float(cfg.get("routed_scaling_factor", 1.0)))
    latent = cfg.get("latent", "routed_expert_down_proj" in weights)
    xe = linear(x, weights["routed_expert_down_proj"]) if latent else x
    y = np.zeros_like(xe)
    for e, ew in enumerate(_experts_list(weights["experts"])):
        rows = np.nonzero(dense_te[:, e])[0]
        if rows.size == 0:
            continue
        y[rows] += dense_te[rows, e][:, None] * mlp(xe[rows], ew["w1"], ew["w3"], ew["w2"],
                                                    act, sb, slb)
    if latent:
        if cfg.get("latent_moe_use_norm", True):
            y = rmsnorm(y, weights["routed_expert_norm"], cfg.get("norm_eps", 1e-5))
        y = linear(y, weights["routed_expert_up_proj"])
    sh = weights.get("shared_experts")
    if sh is not None:
        y = y + mlp(x, sh["gate_proj"], sh["up_proj"], sh["down_proj"], act, sb, slb)
    return y


# ---------------------------------------------------------------------------------------------
# SPEC §7: MXFP4 expert weights
# ---------------------------------------------------------------------------------------------

E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], F64)


def e2m1_decode(nibble) -> np.ndarray:
    """Decode 4-bit e2m1 codes: bit 3 = sign, bits 0-2 index {0,.5,1,1.5,2,3,4,6}."""
    nib = np.asarray(nibble).astype(np.int64) & 0xF
    mag = E2M1_VALUES[nib & 0x7]
    return np.where(nib & 0x8, -mag, mag)


def mxfp4_dequant(packed_rc2, scales_rc32) -> np.ndarray:
    """Dequantise MXFP4 (compressed-tensors ``mxfp4-pack-quantized``, group 32) to float64.

    Args:
      packed_rc2: uint8 ``[R, C/2]``; byte ``j`` holds element ``2j`` in its LOW nibble and
        element ``2j+1`` in its HIGH nibble.
      scales_rc32: uint8 E8M0 ``[R, C/32]``; element ``c`` uses ``scales[:, c // 32]``.

    ``value = e2m1 * 2**(scale - 127)``.  Scale byte 255 (E8M0 NaN in the OCP MX spec) gives NaN.
    Returns ``[R, C]`` float64.
    """
    p = np.asarray(packed_rc2, dtype=np.uint8)
    sc = np.asarray(scales_rc32, dtype=np.uint8)
    R, C2 = p.shape
    C = 2 * C2
    vals = np.empty((R, C), F64)
    vals[:, 0::2] = e2m1_decode(p & 0xF)
    vals[:, 1::2] = e2m1_decode(p >> 4)
    if sc.shape != (R, C // 32):
        raise ValueError(f"scale shape {sc.shape} != {(R, C // 32)}")
    e = sc.astype(np.int64)
    mult = np.where(e == 255, np.nan, np.ldexp(1.0, e - 127))
    return vals * np.repeat(mult, 32, axis=1)


def mxfp4_pack_codes(codes_rc) -> np.ndarray:
    """Inverse helper for tests: pack 4-bit codes ``[R, C]`` into bytes ``[R, C/2]`` (low = even)."""
    c = np.asarray(codes_rc).astype(np.uint8) & 0xF
    return (c[:, 0::2] | (c[:, 1::2] << 4)).astype(np.uint8)


__all__ = [
    "linear", "sigmoid", "silu", "softplus", "rmsnorm", "layernorm", "l2norm", "situ", "swiglu",
    "clamped_swiglu", "activation", "attn_res_mix", "attn_res_forward", "kda_a_log", "kda_gate",
    "causal_depthwise_conv", "kda_recurrence", "kda_chunked", "kda_layer", "mla_q_latent",
    "mla_attention", "mla_absorbed", "indexer_scores", "indexer_keep_mask", "mla_with_indexer",
    "router", "router_dense", "mlp", "moe", "E2M1_VALUES", "e2m1_decode", "mxfp4_dequant",
    "mxfp4_pack_codes",
]
