"""Partition rules: which axis of each parameter splits over the mesh's "model" (tensor) axis, and the routed experts
over the mesh's expert axes (`sharding.mesh.expert_axes`: "model", or ("context", "model") for layouts such as
`expert=8,tensor=1,context=8`).

Rules match parameter paths (as `kimi_jax.model.abstract_params` names them). Heads split for KDA and MLA
(column-parallel in, row-parallel out), routed experts split by expert (expert parallelism),
the vocabulary splits for the embedding and lm_head, dense FFNs split their intermediate width. Small tensors,
the low-rank / latent projections, norms, the router and the indexer stay replicated. A dimension that the axis
size does not divide stays replicated (logged), so any mesh is valid. XLA inserts the collectives (GSPMD).
"""

from __future__ import annotations

import logging
import re

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from .mesh import expert_axes

log = logging.getLogger("kimi_jax.sharding")

MODEL = "model"
EXPERT = "expert"  # marker in RULES: the dimension splits over the mesh's expert axes

# (pattern on the parameter path, dimension split over "model" — or (dim, EXPERT): over the expert axes); first
# match wins; no match = replicated.
RULES: tuple = (
    (r"^embed_tokens$", 0),
    (r"^lm_head\.kernel$", 1),
    (r"self_attn\.indexer\.", -1),  # replicated: the indexer's score is a sum over its heads
    (r"self_attn\.(q_proj|k_proj|v_proj|g_proj|f_b_proj|g_b_proj|b_proj|q_b_proj)\.kernel$", 1),
    (r"self_attn\.(q_conv1d|k_conv1d|v_conv1d)$", 1),
    (r"self_attn\.(A_log|dt_bias)$", 0),
    (r"self_attn\.(k_up_proj|v_up_proj)$", 1),
    (r"self_attn\.o_proj\.kernel$", 0),
    # packed MXFP4 experts split by expert too, in the checkpoint's layout and in the Mosaic GPU kernel's
    # every array of every format (`pallas_kernels.moe.experts`) leads with the expert dimension
    (r"block_sparse_moe\.experts\.", (0, EXPERT)),
    (r"(mlp|shared_experts)\.(gate_proj|up_proj)\.kernel$", 1),
    (r"(mlp|shared_experts)\.down_proj\.kernel$", 0),
)
_COMPILED = tuple((re.compile(p), d) for p, d in RULES)


def param_partition_spec(path: str, shape, model_size: int, *, expert_axes=None) -> P:
    """The PartitionSpec for one parameter on a mesh whose "model" axis has `model_size` devices.
    `expert_axes`: ((axis, size), ...) the routed experts split over (default: "model" with `model_size`)."""
    for pattern, dim in _COMPILED:
        if pattern.search(path):
            if isinstance(dim, tuple):  # routed experts
                dim = dim[0]
                axes = tuple(expert_axes) if expert_axes is not None else ((MODEL, model_size),)
            else:
                axes = ((MODEL, model_size),)
            axes = tuple((a, n) for a, n in axes if n > 1)
            size = 1
            for _, n in axes:
                size *= n
            if dim < 0 or size == 1:
                return P()
            if shape[dim] % size:
                log.info("replicating %s: dim %d of %s does not split %d ways", path, dim, tuple(shape), size)
                return P()
            spec = [None] * len(shape)
            names = tuple(a for a, _ in axes)
            spec[dim] = names[0] if len(names) == 1 else names
            return P(*spec)
    return P()


def mesh_partition_spec(path: str, shape, mesh) -> P:
    """`param_partition_spec` for a concrete mesh (any of its axes may be absent)."""
    model_size = int(mesh.shape.get(MODEL, 1))
    return param_partition_spec(path, shape, model_size,
                                expert_axes=tuple((a, int(mesh.shape[a])) for a in expert_axes(mesh)))


def path_name(path) -> str:
    """A parameter's dotted name ("layers.3.self_attn.q_b_proj.kernel") from its key path in an NNX state."""
    parts = (str(getattr(p, "key", getattr(p, "idx", getattr(p, "name", "")))) for p in path)
    return ".".join(x for x in parts if x and x != "value")


def shard_params(state, mesh):
    """Place every leaf of an NNX parameter State on `mesh` by the rules. Returns the placed State. Abstract
    leaves (`jax.ShapeDtypeStruct`) come back abstract, with their sharding."""
    def place(path, leaf):
        sharding = NamedSharding(mesh, mesh_partition_spec(path_name(path), leaf.shape, mesh))
        if isinstance(leaf, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
        return jax.device_put(leaf, sharding)

    return jax.tree_util.tree_map_with_path(place, state)


def batch_sharding(mesh, ndim: int, batch: int):
    """Inputs split their batch over "data" when it divides, else stay replicated."""
    if batch % mesh.shape.get("data", 1) == 0:
        return NamedSharding(mesh, P("data", *([None] * (ndim - 1))))
    return NamedSharding(mesh, P())
