"""The partitioned entry point of RMSNorm (`pallas_kernels.norm`): the kernel runs per device on its rows (the batch
over the data axis, everything else whole) inside a `shard_map`, where GSPMD cannot split a custom call; the
reference stays plain XLA, which GSPMD partitions as it likes."""

from __future__ import annotations

import math

from pallas_kernels import norm as norm_ops

from .context import ForwardContext
from .partition import shard_call


def rmsnorm(ctx: ForwardContext, x, weight, eps: float):
    """RMSNorm of `x [B, ..., D]` with `weight [D]` -> `[B, ..., D]` in x.dtype, by `ctx.kernels.norm`."""
    backend = norm_ops.resolve_backend(ctx.kernels.norm, ctx.platform)
    if backend == "reference" or not 0 < math.prod(x.shape[:-1]) <= norm_ops.MAX_ROWS:
        return norm_ops.rmsnorm_reference(x, weight, eps)
    body = lambda x, w: (norm_ops.rmsnorm(x, w, eps, backend),)  # noqa: E731
    if ctx.mesh is None:
        return body(x, weight)[0]
    rows = (ctx.axes.data,) + (None,) * (x.ndim - 1)
    return shard_call(ctx, body, (x, weight), (rows, (None,)), (rows,))[0]
