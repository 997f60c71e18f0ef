"""The partitioned KDA entry point: the delta-rule ops of `pallas_kernels.kda` with heads (and their states) over
the tensor axis and the batch over data, inside a `shard_map` (`sharding.partition.shard_call`).

Heads that do not divide the tensor axis split the state's value columns instead (`state_dims`: exact, each
column evolves on its own), so a cache of few heads still splits over the tensor axis.

Per mode (`ForwardContext.mode`):
* plain / head split / DCP / TP decode: each device runs its heads; prefill (T > 1) the chunked op
  (`context_parallel.kda_local_op`: long prompts in segments), decode the recurrent op.
* token split: this device holds a contiguous token slice; its affine state transition is combined with the other
  slices' over the context axis (`context_parallel.kda_token_split_shard`): exact, every device ends with the
  whole prompt's state.

Shapes: q, k `[B, T, H, dk]`, v `[B, T, H, dv]`, g `[B, T, H, dk]` float32 log-decay, beta `[B, T, H]` float32,
state `[B, H, dk, dv]` float32. Returns (o `[B, T, H, dv]` in v.dtype, new state float32).
"""

from __future__ import annotations

from pallas_kernels.kda import ops as kda_ops
from pallas_kernels.kda import reference

from . import context_parallel as cp
from .context import ForwardContext
from .partition import shard_call


def state_dims(ctx: ForwardContext, heads: int, dv: int) -> tuple:
    """How a state `[B, H, dk, dv]` splits: heads over the tensor axis when they divide it, else its value columns
    (each of the dv columns evolves on its own in the delta rule — o_t = S_tᵀ q_t and the update
    β(v − Sᵀk) kᵀ act column by column — so a split over dv is exact), else whole."""
    d, t = ctx.axes.data, ctx.axes.tensor
    ways = ctx.axis_size(t)
    if heads % ways == 0:
        return (d, t, None, None)
    if dv % ways == 0:
        return (d, None, None, t)
    return (d, None, None, None)


def _dims(ctx: ForwardContext, heads: int, dv: int):
    """(q / k / g dims, v / o dims, beta dims, state dims) for the state split of `state_dims`."""
    d, t = ctx.axes.data, ctx.axes.tensor
    st = state_dims(ctx, heads, dv)
    by_heads = st[1] == t
    qk = (d, None, t, None) if by_heads else (d, None, None, None)
    vo = (d, None, t, None) if by_heads else (d, None, None, st[3])
    return qk, vo, (d, None, t) if by_heads else (d, None, None), st


def _backend(ctx: ForwardContext, prefill: bool = False) -> str:
    """The KDA implementation for this context: "auto" resolved against the context's platform. A prefill that
    "auto" sends to the reference on a mesh of several CPU devices runs the token recurrence ("recurrent"): the
    chunked reference's batched LAPACK solve can deadlock jaxlib's XLA:CPU pool when several faked devices run it
    at once (`context_parallel.resolve_kda_backend`)."""
    backend = kda_ops.resolve_backend(ctx.kernels.kda, **ctx.platform_kw())
    several = ctx.mesh is not None and ctx.mesh.size > 1
    if prefill and several and ctx.kernels.kda == "auto" and backend == "reference":
        return "recurrent"
    return backend


def chunk(ctx: ForwardContext, q, k, v, g, beta, state):
    """Prefill of T tokens per sequence from `state` (see the module doc for shapes)."""
    backend = _backend(ctx, prefill=True)
    if ctx.token_split:
        body = lambda *a: cp.kda_token_split_shard(*a, axis=ctx.axes.context, backend=backend)
    else:
        body = lambda *a: cp.kda_local_op(*a, backend=backend)
    qk, vo, per_head, st = _dims(ctx, q.shape[2], v.shape[3])
    return shard_call(ctx, body, (q, k, v, g, beta, state), (qk, qk, vo, qk, per_head, st), (vo, st))


def recurrent(ctx: ForwardContext, q, k, v, g, beta, state, slot_ids=None):
    """The token recurrence over T (usually 1) tokens per sequence from `state`. With `slot_ids` `[B]` (distinct):
    sequence b reads and writes `state[slot_ids[b]]` of a pool `[S, H, dk, dv]`, in place; the pool's slots are
    not split over the data axis (which must then be 1: a slot's row would live on another device)."""
    if ctx.token_split:
        raise ValueError("the token-split prefill runs the chunked KDA op, not the recurrence")
    backend = _backend(ctx)
    qk, vo, per_head, st = _dims(ctx, q.shape[2], v.shape[3])
    if slot_ids is None:
        body = lambda *a: kda_ops.recurrent(*a, backend=backend)
        return shard_call(ctx, body, (q, k, v, g, beta, state), (qk, qk, vo, qk, per_head, st), (vo, st))
    if ctx.axis_size(ctx.axes.data) > 1:
        raise ValueError("a slot-indexed KDA state needs the data axis to be 1 (each device holds every slot)")
    body = lambda q, k, v, g, beta, pool, slots: kda_ops.recurrent(q, k, v, g, beta, pool, slot_ids=slots,
                                                                   backend=backend)
    pool = (None,) + tuple(st[1:])
    return shard_call(ctx, body, (q, k, v, g, beta, state, slot_ids), (qk, qk, vo, qk, per_head, pool, (None,)),
                      (vo, pool))


def decode_step_splits(ctx: ForwardContext, heads: int, dv: int) -> bool:
    """Whether `decode_step` runs on this context: whole heads on each device (`state_dims` splits the heads, or
    nothing) and the data axis 1 (a slot's rows live on every device)."""
    return ctx.axis_size(ctx.axes.data) == 1 and (ctx.axis_size(ctx.axes.tensor) == 1
                                                   or state_dims(ctx, heads, dv)[1] == ctx.axes.tensor)


def decode_step(ctx: ForwardContext, x_in, f, b_logit, gate_logit, conv, A_log, dt_bias, o_norm, pools, slot_ids,
                **kw):
    """`kda_ops.decode_step` (one decode token per sequence, from the projections to the o_proj input, against the
    slots of the layer's pools) with the heads over the tensor axis: the `[B, P]` / `[K, P]` / `[S, K−1, P]` arrays
    split along P by heads, the state pool along H. `decode_step_splits(ctx, …)` must hold. `kw`: gate_form,
    lower_bound, o_norm_eps, scale."""
    t = ctx.axes.tensor
    state, *tails = pools
    if not decode_step_splits(ctx, A_log.shape[0], state.shape[-1]):
        raise ValueError("decode_step needs whole heads per device and a data axis of 1")
    backend = _backend(ctx)

    def body(x_in, f, b_logit, gate_logit, conv, A_log, dt_bias, o_norm, state, tails, slot_ids):
        o, (state, *tails) = kda_ops.decode_step(x_in, f, b_logit, gate_logit, conv, A_log, dt_bias, o_norm,
                                                 (state, *tails), slot_ids, backend=backend, **kw)
        return o, state, tuple(tails)

    cols = (None, t)
    o, state, tails = shard_call(
        ctx, body, (x_in, f, b_logit, gate_logit, conv, A_log, dt_bias, o_norm, state, tuple(tails), slot_ids),
        (cols, cols, cols, cols, cols, (t,), (t,), (None,), (None, t, None, None), (None, None, t), (None,)),
        (cols, (None, t, None, None), (None, None, t)))
    return o, (state, *tails)


def causal_conv(ctx: ForwardContext, x_btp, w_kp, tail_bkp):
    """The short causal conv of q, k or v: (out `[B, T, P]` float32, new tail `[B, K−1, P]`). Under the token split
    the K−1 halo comes from the previous device and the tail is the whole (unpadded) prompt's."""
    if ctx.token_split:
        return cp.conv_token_split_shard(x_btp, w_kp, tail_bkp, axis=ctx.axes.context, valid_len=ctx.valid_len)
    return reference.causal_conv(x_btp, w_kp, tail_bkp)
