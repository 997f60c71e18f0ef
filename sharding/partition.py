"""`shard_call`: run a per-device function (usually a Pallas kernel) under a `shard_map` with an op's own specs.

GSPMD cannot partition a custom call (Mosaic TPU, Mosaic GPU, Triton): every kernel is reached through its family's
entry point, which names, per argument, the mesh axis role each dimension splits over. `shard_call` turns those
into `PartitionSpec`s for the axes that are still automatic where it is traced — a program that is already manual
over some axes (the context-parallel programs) nests a shard_map over the rest — and drops any split that does not
divide its dimension (that dimension stays whole on every device, as `sharding.rules` leaves such parameters).
Without a mesh, or with every axis already manual, the function is called as it is.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import jax
from jax.sharding import PartitionSpec as P

from .context import ForwardContext

Dims = Optional[Sequence]  # per dimension: an axis name, a tuple of names, or None; None for the whole argument


def free_axes(ctx: ForwardContext) -> tuple:
    """The mesh axes not yet manual at this point of the trace."""
    if ctx.mesh is None:
        return ()
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    return tuple(a for a in ctx.mesh.axis_names if a not in manual)


def _spec(ctx: ForwardContext, free: tuple, dims: Dims, shape) -> P:
    if dims is None:
        return P()
    out = []
    for d, names in enumerate(dims):
        names = () if names is None else (names if isinstance(names, tuple) else (names,))
        names = tuple(a for a in names if a in free and ctx.axis_size(a) > 1)
        ways = 1
        for a in names:
            ways *= ctx.axis_size(a)
        if not names or shape is None or shape[d] % ways:
            out.append(None)
        else:
            out.append(names[0] if len(names) == 1 else names)
    return P(*out)


def placement(ctx: ForwardContext, dims: Dims, shape) -> P:
    """The `PartitionSpec` of an array of `shape` whose dimensions split over `dims` (see `Dims`) on `ctx.mesh`,
    outside any shard_map: how caches are placed so that the op entry points take them as they are."""
    return _spec(ctx, tuple(ctx.mesh.axis_names) if ctx.mesh is not None else (), dims, shape)


def shard_call(ctx: ForwardContext, fn: Callable, args: tuple, in_dims: Sequence[Dims], out_dims: Sequence[Dims],
               out_shapes: Optional[Sequence] = None):
    """`fn(*args)` run per device over `ctx.mesh`; `fn` returns a tuple with one entry per `out_dims`.

    in_dims: one `Dims` per argument; an argument that is a pytree (a tuple of pool parts) takes one `Dims` for all
    its leaves, checked against its first leaf's shape. out_dims: the same for each output. `out_shapes`: the
    global output shapes that decide divisibility (default: the shape of an input with the same `Dims`, which must
    then exist). Returns the tuple of global outputs."""
    free = free_axes(ctx)
    if not free:
        return fn(*args)

    def first_shape(a):
        leaves = jax.tree.leaves(a)
        return getattr(leaves[0], "shape", ()) if leaves else None

    in_specs = tuple(_spec(ctx, free, d, first_shape(a)) for a, d in zip(args, in_dims))
    if out_shapes is None:
        by_dims = {tuple(d): first_shape(a) for a, d in zip(args, in_dims) if d is not None}
        out_shapes = tuple(None if d is None else by_dims[tuple(d)] for d in out_dims)
    out_specs = tuple(_spec(ctx, free, d, s) for d, s in zip(out_dims, out_shapes))
    manual = jax.sharding.get_abstract_mesh().manual_axes
    mesh = jax.sharding.get_abstract_mesh() if manual else ctx.mesh
    kw = dict(mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    if set(free) != set(ctx.mesh.axis_names):
        kw["axis_names"] = set(free)
    return jax.shard_map(fn, **kw)(*args)
