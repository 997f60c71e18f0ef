"""Context parallelism: one sequence's tokens split over a mesh axis (named "context" here), for prefill and decode.

Token-split prefill (each device holds a contiguous slice of the prompt, shard i = tokens [i·Tl, (i+1)·Tl)):

* KDA (docs/model.md §4). Per head the delta rule is affine in the state: with D_t = diag(exp g_t) and
  A_t = I − β_t k_t k_tᵀ,
      S_t = A_t D_t S_{t−1} + β_t k_t v_tᵀ,           o_t = S_tᵀ (scale·q_t).
  So a slice maps its incoming state S_in to  S_out = M S_in + S_loc  with  M = A_T D_T ⋯ A_1 D_1  ([dk, dk]) and
  S_loc the slice's state from zero; inside the slice  S_t = M_t S_in + S_t^loc  (M_t the partial product), so
      o_t = o_t^loc + S_inᵀ (M_tᵀ scale·q_t) = o_t^loc + q̃_tᵀ S_in.
  The state's dv columns evolve independently, so M and q̃ come from the SAME chunked op: append dk value columns
  that are zero, with initial state [0 | I]. One call `kda.chunk(q, k, [v | 0], g, β, [0 | I])` returns
  o = [o^loc | q̃] and S = [S_loc | M] (the intra-chunk WY work — Akk, Aqk, (I+Akk)⁻¹ — is shared; only the
  dv-proportional parts double). The op keeps every exponent ≤ 0, and ‖A_t D_t‖ ≤ 1 (β ∈ [0,1], ‖k‖ ≤ 1), so M is
  bounded: nothing overflows. Then (M, S_loc) are all-gathered over the axis, every device runs the N-step prefix
  S_in^0 = S0, S_in^{n+1} = M_n S_in^n + S_loc_n (N small matmuls), takes its own S_in and adds q̃ S_in to its
  outputs. Every device ends with the exact final state S_in^N. The short conv needs the previous shard's last
  K−1 inputs: one `ppermute` halo (`conv_token_split_shard`).
* MLA / DSA indexer (docs/model.md §5–6): queries stay local, the latent rows (and index keys) are all-gathered over
  the axis and each shard attends causally with GLOBAL positions. Cost note: a contiguous split is causally unbalanced
  (the last shard's queries see the most keys); with static shapes every shard scores all T keys and masks.

Head-split prefill (heads over the axis) is here too, for comparison: KDA heads are independent; MLA query heads
split while the latent rows (MQA) and the indexer (small, whole-head sums) are computed on every device.

Decode context parallelism (DCP): the latent + index-key cache of each sequence is split by tokens over the axis
(layout "contiguous": device d holds positions [d·L, (d+1)·L); "round_robin": position p on device p mod N, slot
p div N). One query per sequence: each device scores its keys and keeps a local top-k of (score, position); only those
N·k candidates are all-gathered, ordered by (score desc, position asc) — the reference tie rule — and cut to k.
Every global winner is in its owner's local top-k, so each device attends over its own selected candidates and
returns (o, lse); partials merge with pmax/psum of lse-weighted sums. `decode_comm_bytes` gives the per-step
traffic next to the naive all-gathers of score rows or of latents.

Shapes: q, k `[B, T, H, dk]`, v `[B, T, H, dv]`, g `[B, T, H, dk]`, β `[B, T, H]`, KDA state `[B, H, dk, dv]` f32;
absorbed MLA query `[B, T, H, c]` (c = R + rope), latent rows `[B, S, c]`, values their first R = value_dim columns;
indexer query `[B, T, Hi, d]`, keys `[B, S, d]`, weights `[B, T, Hi]` (Hi^-0.5·d^-0.5 folded in by the caller).
Functions named `*_shard` run inside a `shard_map` over `axis`; the others take global arrays and a mesh.
The WHOLE model (every layer, logits, cache, greedy decode) runs these through `kimi_jax.parallel` (`prefill`,
`decode_step`, `generate`): the KDA and MLA layers call them when their `ForwardContext` names a context-parallel
mode.
The per-shard KDA op is `pallas_kernels.kda.chunk` (the GPU/TPU kernels under backend "auto"); on CPU "auto" means the
token recurrence instead (`resolve_kda_backend`: jaxlib 0.10.2's batched LAPACK solve can deadlock with fake devices).
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from pallas_kernels.kda import ops as kda_ops
from pallas_kernels.kda import reference as kda_ref

from .context import DEFAULT_MAX_CHUNK_BYTES, LAYOUTS

CONTEXT = "context"
# KDA token slices longer than this go through the per-shard op in segments of this many tokens (exact; bounds the
# op's per-call float32 buffers). 0 = never segment.
KDA_SEGMENT_TOKENS = 8192
_HI = jax.lax.Precision.HIGHEST


# ----------------------------------------------------------------------------------------------------------------
# mesh and shard_map plumbing
# ----------------------------------------------------------------------------------------------------------------

def _shard_map(f, mesh, in_specs, out_specs):
    """`jax.shard_map` (jax ≥ 0.10) or the experimental one of older releases; replication checks off."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    from jax.experimental.shard_map import shard_map

    return shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def make_context_mesh(context: int, data: int = 1, devices=None) -> Mesh:
    """A Mesh with axes ("data", "context") over the first data·context devices (`sharding.mesh` only knows
    ("data", "model"); context parallelism gets its own axis name)."""
    devices = list(jax.devices()) if devices is None else list(devices)
    need = data * context
    if context < 1 or data < 1:
        raise ValueError(f"mesh sizes must be positive, got context={context}, data={data}")
    if need > len(devices):
        hint = ""
        if devices and devices[0].platform == "cpu":
            hint = f" On CPU, fake them with XLA_FLAGS=--xla_force_host_platform_device_count={need}."
        raise ValueError(f"a context mesh of {context}x{data} needs {need} devices, only {len(devices)} exist.{hint}")
    return Mesh(np.array(devices[:need]).reshape(data, context), ("data", CONTEXT))


def _batch_axis(mesh: Mesh, axis: str, batch: int):
    """Split the batch over "data" when the mesh has such an axis (other than `axis`) that divides it."""
    if "data" in mesh.axis_names and "data" != axis and mesh.shape["data"] > 1 and batch % mesh.shape["data"] == 0:
        return "data"
    return None


def _prec(dtype):
    return _HI if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def _axis_size(axis: str) -> int:
    return jax.lax.axis_size(axis) if hasattr(jax.lax, "axis_size") else jax.lax.psum(1, axis)


# ----------------------------------------------------------------------------------------------------------------
# KDA: token split (affine shard transitions + prefix) and head split
# ----------------------------------------------------------------------------------------------------------------

def _pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


KDA_BACKENDS = ("auto", "recurrent") + tuple(kda_ops.BACKENDS)


def resolve_kda_backend(backend: str = "auto") -> str:
    """The KDA op used per shard. "auto" → `kda_ops.resolve_backend` on GPU/TPU, but "recurrent" (the token-by-token
    jnp reference) on CPU: the chunked reference's batched LAPACK triangular solve can deadlock jaxlib 0.10.2's
    XLA:CPU intra-op pool when several (fake) devices run it at once — every pool thread ends up blocked in
    `ParallelBatchMap` waiting for batch tasks queued behind the others (seen on a 2-core box; 0.11 builds compile
    that path out). "reference" forces the chunked jnp reference anyway."""
    if backend not in KDA_BACKENDS:
        raise ValueError(f"unknown KDA backend {backend!r}; expected one of {KDA_BACKENDS}")
    if backend == "auto":
        return "recurrent" if jax.default_backend() == "cpu" else kda_ops.resolve_backend("auto")
    return backend


def kda_local_op(q, k, v, g, beta, initial_state=None, *, scale=None, backend: str = "auto", **gate_kw):
    """`pallas_kernels.kda.chunk` for one shard, or the token recurrence for backend "recurrent" (see
    `resolve_kda_backend`). Same arguments (gate fusion included) and returns (o in v.dtype, state f32)."""
    be = resolve_kda_backend(backend)
    B, T, H, dk = q.shape
    seg = KDA_SEGMENT_TOKENS
    if seg and T > seg and T % seg == 0:
        # long slices go through the op in segments of `seg` tokens (a multiple of every chunk size), carrying the
        # state: the same chunk steps in the same order, so the same result, but the op's per-call float32 copies
        # ([T, H, dk + dv] chunked inputs and outputs, 6 GiB each at 64K tokens × 96 heads × 256) are per segment
        n = T // seg
        if initial_state is None:
            initial_state = jnp.zeros((B, H, dk, v.shape[-1]), jnp.float32)
        cut = lambda a: jnp.moveaxis(a.reshape((B, n, seg) + a.shape[2:]), 1, 0)

        def step(S, xs):
            o, S = kda_local_op(*xs, S, scale=scale, backend=be, **gate_kw)
            return S, o

        S, o = jax.lax.scan(step, initial_state.astype(jnp.float32), tuple(map(cut, (q, k, v, g, beta))))
        return jnp.moveaxis(o, 0, 1).reshape((B, T) + o.shape[3:]), S
    if be != "recurrent":
        return kda_ops.chunk(q, k, v, g, beta, initial_state, scale=scale, backend=be, **gate_kw)
    if gate_kw.get("gate_form") is not None:
        H, dk = q.shape[2], q.shape[3]
        g = kda_ref.gate(g, jnp.asarray(gate_kw["A_log"]).reshape(H), jnp.asarray(gate_kw["dt_bias"]).reshape(H, dk),
                         gate_kw["gate_form"], gate_kw.get("lower_bound", -5.0))
    return kda_ref.recurrent(q, k, v, g, beta, initial_state, scale=scale)


def kda_local_transition(q, k, v, g, beta, *, scale=None, backend: str = "auto", fuse: Optional[bool] = None,
                         **gate_kw):
    """A token slice run from a zero state, plus its affine transition. No collectives.

    Returns (o_loc `[B,T,H,dv]` in v.dtype, q̃ `[B,T,H,dk]` in v.dtype, S_loc `[B,H,dk,dv]` f32, M `[B,H,dk,dk]` f32)
    such that, for any incoming state S_in:  outputs = o_loc + q̃ S_in,  final state = M S_in + S_loc.
    `fuse` (default: when dk + dv is a power of two, which the GPU kernel needs) computes everything in one chunk
    call with dv + dk value columns; otherwise two calls (values from zero; zero values from the identity).
    `gate_kw` (gate_form, A_log, dt_bias, lower_bound) pass through to `pallas_kernels.kda.chunk`; `backend` as in
    `resolve_kda_backend`.
    """
    B, T, H, dk = q.shape
    dv = v.shape[-1]
    eye = jnp.broadcast_to(jnp.eye(dk, dtype=jnp.float32), (B, H, dk, dk))
    zeros_v = jnp.zeros((B, T, H, dk), v.dtype)
    if fuse is None:
        fuse = _pow2(dk + dv)
    if fuse:
        v_aug = jnp.concatenate([v, zeros_v], axis=-1)
        s0 = jnp.concatenate([jnp.zeros((B, H, dk, dv), jnp.float32), eye], axis=-1)
        o_aug, s_aug = kda_local_op(q, k, v_aug, g, beta, s0, scale=scale, backend=backend, **gate_kw)
        return o_aug[..., :dv], o_aug[..., dv:], s_aug[..., :dv], s_aug[..., dv:]
    o_loc, s_loc = kda_local_op(q, k, v, g, beta, None, scale=scale, backend=backend, **gate_kw)
    q_eff, m = kda_local_op(q, k, zeros_v, g, beta, eye, scale=scale, backend=backend, **gate_kw)
    return o_loc, q_eff, s_loc, m


def combine_transitions(M_nbhkk, S_loc_nbhkv, S0_bhkv):
    """Prefix over N slices in token order: S_in[0] = S0, S_in[n+1] = M[n] S_in[n] + S_loc[n].
    Returns (S_in `[N, B, H, dk, dv]` — each slice's incoming state, final state `[B, H, dk, dv]`), float32."""

    def step(S, x):
        M, S_loc = x
        return jnp.einsum("bhij,bhjv->bhiv", M, S, precision=_HI) + S_loc, S

    S_final, S_in = jax.lax.scan(step, S0_bhkv.astype(jnp.float32),
                                 (M_nbhkk.astype(jnp.float32), S_loc_nbhkv.astype(jnp.float32)))
    return S_in, S_final


def apply_incoming_state(o_loc, q_eff, S_in_bhkv):
    """Exact outputs of a slice whose incoming state is S_in: o_loc + q̃ S_in (f32 math, cast to o_loc.dtype)."""
    corr = jnp.einsum("bthk,bhkv->bthv", q_eff.astype(jnp.float32), S_in_bhkv, precision=_prec(q_eff.dtype))
    return (o_loc.astype(jnp.float32) + corr).astype(o_loc.dtype)


def kda_token_split_shard(q, k, v, g, beta, initial_state=None, *, axis: str = CONTEXT, scale=None,
                          backend: str = "auto", fuse: Optional[bool] = None, **gate_kw):
    """Inside a shard_map over `axis`: this device's contiguous token slice (shard order = token order).
    Returns (o `[B, Tl, H, dv]`, final state of the whole sequence `[B, H, dk, dv]` f32, the same on every shard).
    Communication: one all-gather of (M, S_loc), B·H·dk·(dk+dv)·4 bytes per device."""
    o_loc, q_eff, S_loc, M = kda_local_transition(q, k, v, g, beta, scale=scale, backend=backend, fuse=fuse,
                                                  **gate_kw)
    B, _, H, dk = q.shape
    S0 = (jnp.zeros((B, H, dk, v.shape[-1]), jnp.float32) if initial_state is None
          else initial_state.astype(jnp.float32))
    Ms = jax.lax.all_gather(M, axis)
    Ss = jax.lax.all_gather(S_loc, axis)
    S_in_all, S_final = combine_transitions(Ms, Ss, S0)
    S_in = S_in_all[jax.lax.axis_index(axis)]
    return apply_incoming_state(o_loc, q_eff, S_in), S_final


def global_rows_shard(x_btp, positions, tail_bkp=None, *, axis: str = CONTEXT):
    """Inside a shard_map over `axis` (contiguous token slices of Tl): rows of x at the static global `positions`
    (ints, each < n·Tl), on every shard, by one owner-masked psum (exact: every row has one owner, the rest add
    zeros). A negative position p reads `tail[:, K−1+p]` (the inputs before the slice; zeros when None).
    Returns `[B, len(positions), P]` in x.dtype."""
    Tl = x_btp.shape[1]
    pos = jnp.asarray(np.asarray(positions, np.int32))
    loc = pos - jax.lax.axis_index(axis) * Tl
    mine = (loc >= 0) & (loc < Tl)
    rows = jnp.take(x_btp, jnp.clip(loc, 0, Tl - 1), axis=1)
    rows = jax.lax.psum(jnp.where(mine[None, :, None], rows, jnp.zeros_like(rows)), axis)
    if tail_bkp is not None:
        k1 = tail_bkp.shape[1]
        before = jnp.take(tail_bkp.astype(rows.dtype), jnp.clip(pos + k1, 0, k1 - 1), axis=1)
        rows = jnp.where((pos < 0)[None, :, None], before, rows)
    return rows


def conv_token_split_shard(x_btp, w_kp, tail_bkp=None, *, axis: str = CONTEXT, valid_len: Optional[int] = None):
    """Causal depthwise conv (`kda.reference.causal_conv`) on a contiguous token slice inside a shard_map: the
    previous shard's last K−1 inputs arrive by one `ppermute` (shard 0 gets `tail`, zeros when None).
    Returns (out `[B, Tl, P]` f32, the whole sequence's new tail `[B, K−1, P]`, on every shard). Needs Tl ≥ K−1.
    `valid_len` (static): only the first valid_len tokens of the n·Tl are real (the rest is padding at the end);
    the new tail is then the K−1 inputs before position valid_len (`global_rows_shard`)."""
    K = w_kp.shape[0]
    n = _axis_size(axis)
    if x_btp.shape[1] < K - 1:
        raise ValueError(f"each shard needs at least {K - 1} tokens for the conv halo, got {x_btp.shape[1]}")
    last = x_btp[:, x_btp.shape[1] - (K - 1):]
    halo = jax.lax.ppermute(last, axis, perm=[(j, j + 1) for j in range(n - 1)])  # shard 0 receives zeros
    if tail_bkp is not None:
        halo = jnp.where(jax.lax.axis_index(axis) == 0, tail_bkp.astype(halo.dtype), halo)
    out, _ = kda_ref.causal_conv(x_btp, w_kp, halo)
    if valid_len is not None and valid_len != n * x_btp.shape[1]:
        return out, global_rows_shard(x_btp, range(valid_len - (K - 1), valid_len), tail_bkp, axis=axis)
    return out, jax.lax.all_gather(last, axis)[n - 1]


_GATE_STATIC = ("gate_form", "lower_bound")


def _split_gate_kw(gate_kw):
    static = {k: gate_kw[k] for k in _GATE_STATIC if k in gate_kw}
    arrays = {k: gate_kw[k] for k in ("A_log", "dt_bias") if gate_kw.get(k) is not None}
    extra = set(gate_kw) - set(_GATE_STATIC) - {"A_log", "dt_bias"}
    if extra:
        raise TypeError(f"unexpected KDA arguments {sorted(extra)}")
    return static, arrays


@functools.lru_cache(maxsize=64)
def _kda_fn(mesh, axis, mode, scale, backend, fuse, batch_axis, static_items, array_names):
    static = dict(static_items)
    tok = P(batch_axis, axis) if mode == "token" else P(batch_axis, None, axis)
    state = P(batch_axis) if mode == "token" else P(batch_axis, axis)
    arr_spec = P() if mode == "token" else P(axis)

    def body(q, k, v, g, beta, s0, *arrays):
        kw = dict(static, **dict(zip(array_names, arrays)))
        if mode == "token":
            return kda_token_split_shard(q, k, v, g, beta, s0, axis=axis, scale=scale, backend=backend, fuse=fuse,
                                         **kw)
        return kda_local_op(q, k, v, g, beta, s0, scale=scale, backend=backend, **kw)

    return jax.jit(_shard_map(body, mesh, (tok,) * 5 + (state,) + (arr_spec,) * len(array_names), (tok, state)))


def _kda_split(mode, q, k, v, g, beta, initial_state, mesh, axis, scale, backend, fuse, gate_kw):
    B, T, H, dk = q.shape
    n = mesh.shape[axis]
    static, arrays = _split_gate_kw(gate_kw)
    pad = 0
    if mode == "token" and T % n:
        if static.get("gate_form") is not None:
            raise ValueError(f"T = {T} must divide over {n} shards when the gate is fused (padding would decay)")
        pad = (-T) % n  # trailing steps with g = 0, β = 0, k = q = v = 0 leave the state unchanged
        padt = lambda a: jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        q, k, v, g, beta = map(padt, (q, k, v, g, beta))
    if mode == "head" and H % n:
        raise ValueError(f"{H} heads do not split over {n} devices")
    if initial_state is None:
        initial_state = jnp.zeros((B, H, dk, v.shape[-1]), jnp.float32)
    if mode == "head" and "A_log" in arrays:
        arrays["A_log"] = jnp.asarray(arrays["A_log"]).reshape(H)
        arrays["dt_bias"] = jnp.asarray(arrays["dt_bias"]).reshape(H * dk)
    f = _kda_fn(mesh, axis, mode, scale, backend, fuse, _batch_axis(mesh, axis, B),
                tuple(sorted(static.items())), tuple(arrays))
    o, s = f(q, k, v, g, beta, initial_state, *arrays.values())
    return (o[:, :T] if pad else o), s


def kda_prefill_token_split(q, k, v, g, beta, initial_state=None, *, mesh: Mesh, axis: str = CONTEXT, scale=None,
                            backend: str = "auto", fuse: Optional[bool] = None, **gate_kw):
    """Token-split KDA prefill over `axis` (global arrays in, global arrays out; equal to `kda.chunk` up to
    rounding). T that does not divide is padded with inert steps (not allowed with a fused gate).
    Returns (o `[B, T, H, dv]`, final state `[B, H, dk, dv]` f32, replicated)."""
    return _kda_split("token", q, k, v, g, beta, initial_state, mesh, axis, scale, backend, fuse, gate_kw)


def kda_prefill_head_split(q, k, v, g, beta, initial_state=None, *, mesh: Mesh, axis: str = CONTEXT, scale=None,
                           backend: str = "auto", **gate_kw):
    """Head-split KDA prefill over `axis` (H must divide): no communication. Same returns, heads sharded."""
    return _kda_split("head", q, k, v, g, beta, initial_state, mesh, axis, scale, backend, None, gate_kw)


@functools.lru_cache(maxsize=16)
def _conv_fn(mesh, axis, has_tail):
    def body(x, w, *tail):
        return conv_token_split_shard(x, w, tail[0] if tail else None, axis=axis)

    return jax.jit(_shard_map(body, mesh, (P(None, axis), P()) + ((P(),) if has_tail else ()),
                              (P(None, axis), P())))


def conv_token_split(x_btp, w_kp, tail_bkp=None, *, mesh: Mesh, axis: str = CONTEXT):
    """Global wrapper of `conv_token_split_shard` (T must divide over the axis)."""
    args = (x_btp, w_kp) + ((tail_bkp,) if tail_bkp is not None else ())
    return _conv_fn(mesh, axis, tail_bkp is not None)(*args)


# ----------------------------------------------------------------------------------------------------------------
# MLA (absorbed) + DSA indexer attention over dense key rows, query-chunked
# ----------------------------------------------------------------------------------------------------------------

def _canon_zero(s):
    """−0.0 → +0.0 so that equal scores order by position only (top_k / sort see −0.0 < +0.0)."""
    return jnp.where(s == 0, jnp.zeros_like(s), s)


def index_scores(qi_bthd, ki_bsd, w_bth, allowed_bts):
    """score[b,t,s] = Σ_h w[b,t,h]·relu(qi[b,t,h]·ki[b,s]), −inf where not allowed; float32 (docs/model.md §6)."""
    dots = jnp.einsum("bthd,bsd->bths", qi_bthd, ki_bsd, preferred_element_type=jnp.float32,
                      precision=_prec(qi_bthd.dtype))
    s = jnp.einsum("bth,bths->bts", w_bth.astype(jnp.float32), jax.nn.relu(dots), precision=_HI)
    return jnp.where(allowed_bts, _canon_zero(s), -jnp.inf)


def select_topk(scores_bts, topk: int):
    """Top-k positions `[B, T, topk]` int32 per row, best first, −1 where fewer keys are allowed (−inf scores).
    Ties: the earlier position wins (lax.top_k is stable)."""
    S = scores_bts.shape[-1]
    if S < topk:
        scores_bts = jnp.pad(scores_bts, ((0, 0), (0, 0), (0, topk - S)), constant_values=-jnp.inf)
    vals, idx = jax.lax.top_k(scores_bts, topk)
    return jnp.where(vals > -jnp.inf, idx, -1).astype(jnp.int32)


def _softmax_attend(q_bthc, rows_btjc, valid_btj, scale: float, value_dim: int):
    """Masked softmax attention of each query over its own rows. Returns (o `[B,T,H,R]` f32, lse `[B,T,H]` f32);
    a query with no valid row gets o = 0, lse = −inf."""
    s = jnp.einsum("bthc,btjc->bthj", q_bthc, rows_btjc, preferred_element_type=jnp.float32,
                   precision=_prec(q_bthc.dtype)) * scale
    ok = valid_btj[:, :, None, :]
    s = jnp.where(ok, s, -jnp.inf)
    m = jnp.max(s, axis=-1)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(ok, jnp.exp(s - m[..., None]), 0.0)
    den = jnp.sum(p, axis=-1)
    safe = jnp.where(den > 0, den, 1.0)
    o = jnp.einsum("bthj,btjr->bthr", p.astype(rows_btjc.dtype), rows_btjc[..., :value_dim],
                   preferred_element_type=jnp.float32, precision=_prec(rows_btjc.dtype)) / safe[..., None]
    lse = jnp.where(den > 0, m + jnp.log(safe), -jnp.inf)
    return o, lse


def _gather_rows(rows_bsc, idx_btk):
    return jax.vmap(lambda r, i: r[jnp.maximum(i, 0)])(rows_bsc, idx_btk)


def mla_query_chunk(B: int, H: int, c: int, S: int, T: int, topk: Optional[int], index_heads: int = 0,
                    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES) -> int:
    """Queries per chunk so one chunk's float32 intermediates stay under `max_chunk_bytes`: dense — logits
    `[B, Tc, H, S]`; sparse — index logits `[B, Tc, Hi, S]` + gathered rows `[B, Tc, k, c]` + logits `[B, Tc, H, k]`."""
    per_q = B * H * S * 4 if topk is None else B * 4 * (index_heads * S + topk * c + H * topk)
    return int(max(1, min(T, max_chunk_bytes // max(1, per_q))))


def mla_attend(q_bthc, kv_bsc, q_pos_t, *, scale: float, value_dim: int, qi_bthd=None, ki_bsd=None, w_bth=None,
               topk: Optional[int] = None, q_chunk: Optional[int] = None,
               max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES, return_indices: bool = False, query_fn=None,
               out_fn=None):
    """Causal absorbed MLA of queries at global positions `q_pos_t` `[T]` over key rows kv `[B, S, c]` at positions
    0…S−1 (key s allowed iff s ≤ pos). With the indexer (qi, ki, w, topk): each query attends only its top-k keys
    (gathered rows); without it: dense causal attention. Queries go in chunks (`mla_query_chunk`).
    `query_fn` (optional): q_bthc is then a tuple of per-token query pieces `[B, T, ...]` (e.g. the bf16 q_nope and
    q_rope) and `query_fn(*pieces of one chunk)` gives that chunk's absorbed query `[B, tc, H, c]` — so the float32
    absorbed query of all T tokens (T·H·c·4 bytes: 13.5 GiB at 64K tokens × 96 heads × 576) never exists at once.
    `out_fn` (optional, per token): applied to each chunk's o `[B, tc, H, R]` inside the chunk loop (e.g. the W_UV
    up-projection to `[B, tc, H, v]`), so the float32 latent output of all T tokens (T·H·R·4 bytes: 12 GiB at
    128K tokens × 48 heads × 512, and as much again for its transposed copy) never exists at once.
    Returns (o `[B, T, H, R]` f32 — or out_fn's per-token result —, lse `[B, T, H]` f32) and, with return_indices,
    idx `[B, T, topk]` int32."""
    pieces = tuple(q_bthc) if query_fn is not None else (q_bthc,)
    if query_fn is not None:
        B, T = pieces[0].shape[:2]
        _, _, H, c = jax.eval_shape(query_fn, *(jax.ShapeDtypeStruct((B, 1) + a.shape[2:], a.dtype)
                                                for a in pieces)).shape
    else:
        B, T, H, c = q_bthc.shape
    S = kv_bsc.shape[1]
    sparse = topk is not None
    if sparse and (qi_bthd is None or ki_bsd is None or w_bth is None):
        raise ValueError("sparse (top-k) attention needs the indexer query, keys and weights")
    Hi = qi_bthd.shape[2] if sparse else 0
    k_eff = topk if sparse else 0
    tc = q_chunk or mla_query_chunk(B, H, c, S, T, topk, Hi, max_chunk_bytes)
    n = -(-T // tc)
    pad = n * tc - T
    key_pos = jnp.arange(S, dtype=jnp.int32)
    q_pos_t = jnp.asarray(q_pos_t, jnp.int32)

    def padt(a, value=0):
        return jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2), constant_values=value) if pad else a

    npc = len(pieces)
    pos = jnp.pad(q_pos_t, (0, pad), constant_values=-1) if pad else q_pos_t
    xs = [padt(a) for a in pieces] + [pos[None].repeat(B, 0)]
    if sparse:
        xs += [padt(qi_bthd), padt(w_bth)]
    split = lambda a: jnp.moveaxis(a.reshape((B, n, tc) + a.shape[2:]), 1, 0)
    xs = [split(a) for a in xs]

    post = out_fn if out_fn is not None else (lambda o: o)

    def one(args):
        qc = query_fn(*args[:npc]) if query_fn is not None else args[0]
        pc = args[npc]
        allowed = key_pos[None, None, :] <= pc[:, :, None]  # [B, tc, S]
        if sparse:
            s = index_scores(args[npc + 1], ki_bsd, args[npc + 2], allowed)
            idx = select_topk(s, k_eff)
            o, lse = _softmax_attend(qc, _gather_rows(kv_bsc, idx), idx >= 0, scale, value_dim)
            return post(o), lse, idx
        rows = jnp.broadcast_to(kv_bsc[:, None], (B, qc.shape[1], S, c))
        o, lse = _softmax_attend(qc, rows, allowed, scale, value_dim)
        return post(o), lse, jnp.zeros((B, qc.shape[1], 0), jnp.int32)

    o, lse, idx = jax.lax.map(one, xs)
    join = lambda a: jnp.moveaxis(a, 0, 1).reshape((B, n * tc) + a.shape[3:])[:, :T]
    out = (join(o), join(lse))
    return out + (join(idx),) if return_indices else out


def mla_token_split_shard(q_bthc, kv_btc, qi_bthd=None, ki_btd=None, w_bth=None, *, axis: str = CONTEXT,
                          scale: float, value_dim: int, topk: Optional[int] = None, q_chunk: Optional[int] = None,
                          max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES, return_indices: bool = False):
    """Inside a shard_map over `axis`: this shard's contiguous slice of queries AND of the rows of the same tokens.
    All-gathers the latent rows (and index keys) over the axis and attends with global positions."""
    Tl = q_bthc.shape[1]
    kv_all = jax.lax.all_gather(kv_btc, axis, axis=1, tiled=True)
    ki_all = None if ki_btd is None else jax.lax.all_gather(ki_btd, axis, axis=1, tiled=True)
    pos = jax.lax.axis_index(axis) * Tl + jnp.arange(Tl, dtype=jnp.int32)
    return mla_attend(q_bthc, kv_all, pos, scale=scale, value_dim=value_dim, qi_bthd=qi_bthd, ki_bsd=ki_all,
                      w_bth=w_bth, topk=topk, q_chunk=q_chunk, max_chunk_bytes=max_chunk_bytes,
                      return_indices=return_indices)


def mla_head_split_shard(q_bthc, kv_btc, qi_bthd=None, ki_btd=None, w_bth=None, *, scale: float, value_dim: int,
                         topk: Optional[int] = None, q_chunk: Optional[int] = None,
                         max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES, return_indices: bool = False):
    """Inside a shard_map: this device's query heads, every token, all latent rows; the indexer (its whole head sum)
    runs on every device, so the top-k sets agree without communication."""
    T = q_bthc.shape[1]
    return mla_attend(q_bthc, kv_btc, jnp.arange(T, dtype=jnp.int32), scale=scale, value_dim=value_dim,
                      qi_bthd=qi_bthd, ki_bsd=ki_btd, w_bth=w_bth, topk=topk, q_chunk=q_chunk,
                      max_chunk_bytes=max_chunk_bytes, return_indices=return_indices)


@functools.lru_cache(maxsize=64)
def _mla_fn(mesh, axis, mode, scale, value_dim, topk, q_chunk, max_chunk_bytes, batch_axis, return_indices):
    sparse = topk is not None
    kw = dict(scale=scale, value_dim=value_dim, topk=topk, q_chunk=q_chunk, max_chunk_bytes=max_chunk_bytes,
              return_indices=return_indices)
    if mode == "token":
        t = P(batch_axis, axis)
        in_specs = (t, t) + ((t, t, t) if sparse else ())
        out_specs = (t, t) + ((t,) if return_indices else ())
        body = functools.partial(mla_token_split_shard, axis=axis, **kw)
    else:
        h, rep = P(batch_axis, None, axis), P(batch_axis)
        in_specs = (h, rep) + ((rep, rep, rep) if sparse else ())
        out_specs = (h, h) + ((rep,) if return_indices else ())
        body = functools.partial(mla_head_split_shard, **kw)
    return jax.jit(_shard_map(body, mesh, in_specs, out_specs))


def _mla_split(mode, q, kv, qi, ki, w, mesh, axis, scale, value_dim, topk, q_chunk, max_chunk_bytes, return_indices):
    n = mesh.shape[axis]
    B, T, H, _ = q.shape
    if mode == "token" and T % n:
        raise ValueError(f"T = {T} tokens do not split over {n} shards")
    if mode == "head" and H % n:
        raise ValueError(f"{H} heads do not split over {n} devices")
    f = _mla_fn(mesh, axis, mode, float(scale), int(value_dim), topk, q_chunk, max_chunk_bytes,
                _batch_axis(mesh, axis, B), return_indices)
    args = (q, kv) + ((qi, ki, w) if topk is not None else ())
    return f(*args)


def mla_prefill_token_split(q_bthc, kv_btc, qi_bthd=None, ki_btd=None, w_bth=None, *, mesh: Mesh,
                            axis: str = CONTEXT, scale: float, value_dim: int, topk: Optional[int] = None,
                            q_chunk: Optional[int] = None, max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
                            return_indices: bool = False):
    """Token-split causal MLA (+ DSA top-k when `topk` is given) prefill of one prompt (positions 0…T−1): global
    arrays in, (o `[B,T,H,R]` f32, lse `[B,T,H]`[, idx `[B,T,k]`]) out, split by tokens."""
    return _mla_split("token", q_bthc, kv_btc, qi_bthd, ki_btd, w_bth, mesh, axis, scale, value_dim, topk, q_chunk,
                      max_chunk_bytes, return_indices)


def mla_prefill_head_split(q_bthc, kv_btc, qi_bthd=None, ki_btd=None, w_bth=None, *, mesh: Mesh,
                           axis: str = CONTEXT, scale: float, value_dim: int, topk: Optional[int] = None,
                           q_chunk: Optional[int] = None, max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
                           return_indices: bool = False):
    """Head-split version of `mla_prefill_token_split` (H must divide); outputs split by heads."""
    return _mla_split("head", q_bthc, kv_btc, qi_bthd, ki_btd, w_bth, mesh, axis, scale, value_dim, topk, q_chunk,
                      max_chunk_bytes, return_indices)


# ----------------------------------------------------------------------------------------------------------------
# Decode context parallelism (DCP)
# ----------------------------------------------------------------------------------------------------------------

def dcp_positions(n: int, slots: int, layout: str = "contiguous") -> np.ndarray:
    """`[n, slots]` global position held by device d at local slot l."""
    d, l = np.meshgrid(np.arange(n), np.arange(slots), indexing="ij")
    if layout == "contiguous":
        return (d * slots + l).astype(np.int32)
    if layout == "round_robin":
        return (l * n + d).astype(np.int32)
    raise ValueError(f"unknown DCP layout {layout!r}; choose one of {LAYOUTS}")


def dcp_place(cache_bs_, n: int, layout: str = "contiguous"):
    """Reorder a position-ordered cache `[B, S, ...]` (S divisible by n) into DCP storage order: device d's
    `S/n` slots are rows [d·S/n, (d+1)·S/n) of the result, so sharding axis 1 over the context axis places them."""
    B, S = cache_bs_.shape[:2]
    if S % n:
        raise ValueError(f"cache length {S} must divide over {n} devices")
    if layout == "contiguous":
        return cache_bs_
    if layout == "round_robin":
        rest = cache_bs_.shape[2:]
        a = cache_bs_.reshape((B, S // n, n) + rest)
        return jnp.swapaxes(a, 1, 2).reshape((B, S) + rest)
    raise ValueError(f"unknown DCP layout {layout!r}; choose one of {LAYOUTS}")


def merge_over_axis(o_bhr, lse_bh, axis, scatter_dim: Optional[int] = None):
    """Exact merge of partial attention over disjoint key sets held by the devices of `axis` (pmax + psum):
    o `[..., R]`, lse `[...]` per device -> the same (o, lse) on every device.
    `scatter_dim` (a dimension of lse, e.g. the tokens): each device keeps only its own contiguous share of that
    dimension — device i the i-th of n equal blocks — by a reduce-scatter instead of the all-reduce (the engine's
    token-split prefill: every device merged the whole chunk's queries but keeps its own tokens)."""
    m = jax.lax.pmax(lse_bh, axis)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    wgt = jnp.where(jnp.isfinite(lse_bh), jnp.exp(lse_bh - m), 0.0)
    if scatter_dim is None:
        total = lambda a: jax.lax.psum(a, axis)
    else:
        total = lambda a: jax.lax.psum_scatter(a, axis, scatter_dimension=scatter_dim, tiled=True)
        share = m.shape[scatter_dim] // _axis_size(axis)
        m = jax.lax.dynamic_slice_in_dim(m, jax.lax.axis_index(axis) * share, share, scatter_dim)
    den = total(wgt)
    num = total(wgt[..., None] * o_bhr)
    safe = jnp.where(den > 0, den, 1.0)
    return num / safe[..., None], jnp.where(den > 0, m + jnp.log(safe), -jnp.inf)


def merge_topk_candidates(vals, pos, axis, topk: int):
    """The global top-k of every device's candidates along `axis`: vals `[..., k]` float32 scores (−inf = no
    candidate), pos `[..., k]` int32 their global positions. Returns (scores, positions) `[..., topk]`, the same on
    every device, ordered by score descending and on equal scores the earlier position first (the one-device tie
    rule); positions −1 (scores −inf) past the candidates. Exact whenever each device's candidates are its own
    top-k: every global winner is in its owner's local top-k."""
    last = vals.ndim - 1
    big = jnp.iinfo(jnp.int32).max
    all_s = jax.lax.all_gather(vals, axis, axis=last, tiled=True)
    all_p = jax.lax.all_gather(jnp.where(vals > -jnp.inf, pos, big), axis, axis=last, tiled=True)
    neg_s, key_p = jax.lax.sort((-all_s, all_p), dimension=-1, num_keys=2)
    win_s, win_p = -neg_s[..., :topk], key_p[..., :topk]
    short = topk - win_s.shape[-1]
    if short > 0:
        pad = [(0, 0)] * last + [(0, short)]
        win_s, win_p = jnp.pad(win_s, pad, constant_values=-jnp.inf), jnp.pad(win_p, pad)
    return win_s, jnp.where(win_s > -jnp.inf, win_p, -1)


def dcp_decode_shard(q_bhc, kv_blc, seq_lens_b, qi_bhd=None, ki_bld=None, w_bh=None, *, axis: str = CONTEXT,
                     layout: str = "contiguous", scale: float, value_dim: int, topk: Optional[int] = None):
    """Inside a shard_map over `axis`: one query per sequence (at position seq_len − 1, its own key cached) against
    this device's L cache slots. Returns (o `[B, H, R]` f32, lse `[B, H]` f32, selected positions `[B, topk]` int32
    ordered best first, −1 padded — the same on every device; `[B, 0]` without the indexer).
    Communication: all-gather of min(topk, L) (score f32, position i32) candidates per sequence, then pmax/psum of
    lse-weighted partial outputs (B·H·(R+2) floats)."""
    n = _axis_size(axis)
    B, L = kv_blc.shape[:2]
    d = jax.lax.axis_index(axis)
    slot = jnp.arange(L, dtype=jnp.int32)
    pos_l = d * L + slot if layout == "contiguous" else slot * n + d
    valid_bl = pos_l[None, :] < jnp.asarray(seq_lens_b, jnp.int32)[:, None]
    if topk is None:  # dense MLA (no indexer): attend every local key
        rows, ok = kv_blc[:, None], valid_bl[:, None]
        sel = jnp.zeros((B, 0), jnp.int32)
    else:
        s = index_scores(qi_bhd[:, None], ki_bld, w_bh[:, None], valid_bl[:, None])[:, 0]  # [B, L]
        kl = min(topk, L)
        vals, li = jax.lax.top_k(s, kl)  # ties: lower slot = earlier position, in both layouts
        cpos = jnp.where(vals > -jnp.inf, pos_l[li], -1)
        _, sel = merge_topk_candidates(vals, cpos, axis, topk)  # [B, topk]
        mine = (cpos >= 0) & jnp.any(cpos[:, :, None] == sel[:, None, :], axis=-1)  # [B, kl]
        rows, ok = _gather_rows(kv_blc, li)[:, None], mine[:, None]  # [B, 1, kl, c]
    o, lse = _softmax_attend(q_bhc[:, None], rows, ok, scale, value_dim)
    o, lse = merge_over_axis(o[:, 0], lse[:, 0], axis)
    return o, lse, sel


def head_split_decode_shard(q_bhc, kv_bsc, seq_lens_b, qi_bhd=None, ki_bsd=None, w_bh=None, *, scale: float,
                            value_dim: int, topk: Optional[int] = None):
    """TP decode inside a shard_map: this device's query heads over the WHOLE (replicated) cache; the indexer runs
    on every device. Returns (o `[B, H_local, R]`, lse `[B, H_local]`, selected positions `[B, topk]`)."""
    S = kv_bsc.shape[1]
    pos = jnp.asarray(seq_lens_b, jnp.int32) - 1
    allowed = (jnp.arange(S, dtype=jnp.int32)[None, :] <= pos[:, None])[:, None]  # [B, 1, S]
    if topk is None:
        rows, ok = kv_bsc[:, None], allowed
        sel = jnp.zeros((q_bhc.shape[0], 0), jnp.int32)
    else:
        idx = select_topk(index_scores(qi_bhd[:, None], ki_bsd, w_bh[:, None], allowed), topk)  # [B, 1, k]
        rows, ok, sel = _gather_rows(kv_bsc, idx), idx >= 0, idx[:, 0]
    o, lse = _softmax_attend(q_bhc[:, None], rows, ok, scale, value_dim)
    return o[:, 0], lse[:, 0], sel


@functools.lru_cache(maxsize=64)
def _decode_fn(mesh, axis, mode, layout, scale, value_dim, topk, batch_axis):
    sparse = topk is not None
    rep = P(batch_axis)
    if mode == "dcp":
        c = P(batch_axis, axis)
        in_specs = (rep, c, rep) + ((rep, c, rep) if sparse else ())
        out_specs = (rep, rep, rep)
        body = functools.partial(dcp_decode_shard, axis=axis, layout=layout, scale=scale, value_dim=value_dim,
                                 topk=topk)
    else:
        h = P(batch_axis, axis)
        in_specs = (h, rep, rep) + ((rep, rep, rep) if sparse else ())
        out_specs = (h, h, rep)
        body = functools.partial(head_split_decode_shard, scale=scale, value_dim=value_dim, topk=topk)
    return jax.jit(_shard_map(body, mesh, in_specs, out_specs))


def dcp_decode(q_bhc, kv_store_bsc, seq_lens_b, qi_bhd=None, ki_store_bsd=None, w_bh=None, *, mesh: Mesh,
               axis: str = CONTEXT, layout: str = "contiguous", scale: float, value_dim: int,
               topk: Optional[int] = None):
    """DCP decode step: caches in DCP storage order (`dcp_place`), `[B, N·L, ·]`, split over `axis` on dim 1.
    Returns (o `[B, H, R]` f32, lse `[B, H]`, selected positions `[B, topk]`), replicated."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown DCP layout {layout!r}; choose one of {LAYOUTS}")
    n = mesh.shape[axis]
    if kv_store_bsc.shape[1] % n:
        raise ValueError(f"cache length {kv_store_bsc.shape[1]} must divide over {n} devices")
    f = _decode_fn(mesh, axis, "dcp", layout, float(scale), int(value_dim), topk,
                   _batch_axis(mesh, axis, q_bhc.shape[0]))
    args = (q_bhc, kv_store_bsc, seq_lens_b) + ((qi_bhd, ki_store_bsd, w_bh) if topk is not None else ())
    return f(*args)


def head_split_decode(q_bhc, kv_bsc, seq_lens_b, qi_bhd=None, ki_bsd=None, w_bh=None, *, mesh: Mesh,
                      axis: str = CONTEXT, scale: float, value_dim: int, topk: Optional[int] = None):
    """TP (head-split) decode step over `axis` with the cache replicated, position-ordered `[B, S, ·]`.
    Returns (o `[B, H, R]`, lse `[B, H]` split by heads, selected positions `[B, topk]`)."""
    if q_bhc.shape[1] % mesh.shape[axis]:
        raise ValueError(f"{q_bhc.shape[1]} heads do not split over {mesh.shape[axis]} devices")
    f = _decode_fn(mesh, axis, "tp", "contiguous", float(scale), int(value_dim), topk,
                   _batch_axis(mesh, axis, q_bhc.shape[0]))
    args = (q_bhc, kv_bsc, seq_lens_b) + ((qi_bhd, ki_bsd, w_bh) if topk is not None else ())
    return f(*args)


# ----------------------------------------------------------------------------------------------------------------
# communication accounting
# ----------------------------------------------------------------------------------------------------------------

def decode_comm_bytes(*, n: int, batch: int, heads: int, value_dim: int, seq_len: int, topk: Optional[int],
                      latent_row_bytes: int = 576, index_row_bytes: int = 132) -> dict:
    """Per decode step and MLA layer, bytes for one device. `payload_*`: what one device contributes to the
    step's collectives (the operands' sizes; what `dcp_decode_shard` traces to); `recv_*`: what one device receives
    on a ring (all-gather: (n−1)·payload; all-reduce: 2(n−1)/n·payload).

    dcp             : all-gather of min(topk, L) (f32 score, i32 position) per sequence + pmax/psum merge of
                      B·H·(R+2) f32 (lse max, weight sum, weighted outputs)
    naive_scores    : all-gather of each device's L score rows (f32) + the same merge
    naive_latents   : all-gather of each device's L latent rows + index keys (then everything local, no merge)
    L = ceil(seq_len / n) cache slots per device; row bytes default to FP8 latent (576) + FP8 index key (132).
    """
    L = -(-seq_len // n)
    kl = L if topk is None else min(topk, L)
    merge = batch * heads * (value_dim + 2) * 4
    cand = 0 if topk is None else batch * kl * 8
    scores = 0 if topk is None else batch * L * 4
    latents = batch * L * (latent_row_bytes + (index_row_bytes if topk is not None else 0))
    ag = lambda p: (n - 1) * p
    ar = lambda p: 2 * (n - 1) * p / n
    out = {
        "slots_per_device": L,
        "payload_dcp": cand + merge,
        "payload_dcp_candidates": cand,
        "payload_merge": merge,
        "payload_naive_scores": scores + merge,
        "payload_naive_latents": latents,
        "recv_dcp": ag(cand) + ar(merge),
        "recv_naive_scores": ag(scores) + ar(merge),
        "recv_naive_latents": ag(latents),
    }
    return out


def prefill_comm_bytes(*, n: int, batch: int, tokens: int, kda_heads: int, dk: int, dv: int, hidden: int,
                       latent_row_bytes: int = 1152, index_row_bytes: int = 256, conv_channels: Optional[int] = None,
                       act_bytes: int = 2, conv_taps: int = 4) -> dict:
    """Per layer, bytes one device receives on a ring, for one KDA and one MLA(+indexer) layer.
    token split: KDA all-gather of (M, S_loc) f32 + conv halo (ppermute, (K−1)·3P) ; MLA all-gather of the other
    shards' latent rows + index keys. head split (Megatron-style, activations replicated): one all-reduce of the
    layer output [B, T, hidden] per layer (KDA and MLA alike)."""
    P_ = conv_channels if conv_channels is not None else kda_heads * dk
    kda_tok = (n - 1) * batch * kda_heads * dk * (dk + dv) * 4 + batch * (conv_taps - 1) * 3 * P_ * act_bytes
    mla_tok = (n - 1) * batch * (tokens // n) * (latent_row_bytes + index_row_bytes)
    head = 2 * (n - 1) * batch * tokens * hidden * act_bytes / n
    return {"token_kda": kda_tok, "token_mla": mla_tok, "head_kda": head, "head_mla": head}


__all__ = [
    "CONTEXT", "LAYOUTS", "KDA_BACKENDS", "make_context_mesh", "resolve_kda_backend", "kda_local_op",
    "kda_local_transition", "combine_transitions", "apply_incoming_state", "kda_token_split_shard",
    "kda_prefill_token_split", "kda_prefill_head_split", "conv_token_split_shard", "conv_token_split",
    "index_scores", "select_topk", "mla_attend", "mla_query_chunk", "mla_token_split_shard", "mla_head_split_shard",
    "mla_prefill_token_split", "mla_prefill_head_split",
    "dcp_positions", "dcp_place", "dcp_decode_shard", "dcp_decode", "head_split_decode_shard", "head_split_decode",
    "decode_comm_bytes", "prefill_comm_bytes", "global_rows_shard",
]
