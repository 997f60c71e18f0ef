"""The partitioned entry point of the routed-expert FFN (docs/model.md §7): where each expert lives, never under GSPMD.

* A mesh whose expert axes (`AxisRoles.expert`: "model", or ("context", "model") on the overlay meshes) split the
  routed experts — E divides by their size, as `sharding.rules` requires to split them at all — runs the FFN
  expert-parallel: `expert_parallel.ep_expert_ffn` from a program whose axes are automatic, and
  `expert_parallel.ep_expert_ffn_manual` from inside the context-parallel programs (tokens split over the context
  axis under the token-split prefill when that axis holds experts; the same tokens on every device otherwise, with
  the partial sums reduced over the expert axes).
* Otherwise the experts are whole on every device, and so is the FFN: the kernel runs under a `shard_map` with
  every argument replicated.

Shapes: x `[N, D]`, expert ids `[N, k]` int32, weights `[N, k]` float32, the routed experts' weights in one of the
MoE kernels' formats (`pallas_kernels.moe.experts`: `DenseExperts`, `MXFP4Experts`, `MosaicMXFP4Experts`; the
kernels take each weight in its own layout). Returns `[N, D]` float32.
"""

from __future__ import annotations

import functools
import math

import jax

from pallas_kernels.moe import gpu_route
from pallas_kernels.moe import ops as moe_ops
from pallas_kernels.moe import routing
from pallas_kernels.moe.experts import ExpertWeights

from .context import ForwardContext
from . import expert_parallel
from .partition import free_axes, shard_call


def expert_ways(ctx: ForwardContext, num_experts: int) -> int:
    """How many ways the routed experts split on this context's mesh (1: whole on every device)."""
    ways = math.prod(ctx.axis_size(a) for a in ctx.axes.expert)
    return ways if ways > 1 and num_experts % ways == 0 else 1


@functools.partial(jax.jit, static_argnames=("activation", "backend", "interpret"))
def _expert_ffn(x_nd, expert_idx_nk, weight_nk, w_gate, w_up, w_down, activation, *, backend: str, interpret: bool):
    """`moe_ops.expert_ffn` as one jitted function: every layer with the same shapes calls the same lowered callee,
    so a model's MoE kernels are lowered once per program, not once per layer (a Mosaic GPU kernel's lowering is
    tenths of a second of Python)."""
    return moe_ops.expert_ffn(x_nd, expert_idx_nk, weight_nk, w_gate, w_up, w_down, activation, backend=backend,
                              interpret=interpret)


def select_experts(ctx: ForwardContext, logits_ne, bias_e, cfg, *, quantized: bool):
    """The routing of `logits_ne [N, E]` float32 with the selection bias `bias_e [E]` -> (weights `[N, k]` float32,
    expert ids `[N, k]` int32), `routing.select_experts`. Where the MoE kernels run natively on a GPU (or through
    Triton's interpreter) and the batch fits one program, it is one kernel (`gpu_route.select_experts`), run on
    every device with its arguments whole; elsewhere the XLA ops, which GSPMD partitions. `quantized`: whether the
    routed experts are MXFP4 (the backend choice depends on it)."""
    backend = moe_ops.resolve_backend(ctx.kernels.moe, quantized=quantized, platform=ctx.platform)
    interpret = ctx.kernels.moe_interpret
    N, E = logits_ne.shape
    if backend != "gpu" or not gpu_route.takes(N, E) or not (interpret or gpu_route.available()):
        return routing.select_experts(logits_ne, bias_e, cfg)
    body = lambda logits, bias: gpu_route.select_experts(logits, bias, cfg, interpret=interpret)
    if ctx.mesh is None:
        return body(logits_ne, bias_e)
    return shard_call(ctx, body, (logits_ne, bias_e), (None, None), (None, None),
                      out_shapes=((N, cfg.top_k), (N, cfg.top_k)))


def routed_experts(ctx: ForwardContext, x_nd, expert_idx_nk, weight_nk, experts: ExpertWeights, activation, *,
                   num_experts: int):
    """Σ_k weight[n,k] · FFN_e(x[n]) over the routed (token, expert) pairs, on this context's mesh."""
    backend = ctx.kernels.moe
    if ctx.platform is not None:  # "auto" for the target platform, not this host's
        backend = moe_ops.resolve_backend(backend, quantized=experts.quantized, platform=ctx.platform)
    kw = dict(backend=backend, interpret=ctx.kernels.moe_interpret)
    args = (x_nd, expert_idx_nk, weight_nk, *experts.weights())
    if ctx.mesh is None:
        return _expert_ffn(*args, activation, **kw)
    manual = len(free_axes(ctx)) < len(ctx.mesh.axis_names)
    if expert_ways(ctx, num_experts) > 1:
        if manual:  # inside a context-parallel program
            ctx_axis = ctx.axes.context
            token_axis = ctx_axis if ctx.token_split and ctx_axis in ctx.axes.expert else None
            return expert_parallel.ep_expert_ffn_manual(*args, activation, expert_axes=ctx.axes.expert, token_axis=token_axis, **kw)
        return expert_parallel.ep_expert_ffn(*args, activation, mesh=ctx.mesh, expert_axes=ctx.axes.expert, **kw)
    body = lambda *a: (_expert_ffn(*a, activation, **kw),)
    (y,) = shard_call(ctx, body, args, (None,) * 6, (None,), out_shapes=(x_nd.shape,))
    return y
