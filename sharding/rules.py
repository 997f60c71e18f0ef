"""Partition rules: which axis of each parameter splits over the mesh's "model" axis.

Rules match parameter paths (as `kimi_jax.model.abstract_params` names them). Heads split for KDA and MLA
(column-parallel in, row-parallel out), routed experts split by expert (expert parallelism over the same axis),
the vocabulary splits for the embedding and lm_head, dense FFNs split their intermediate width. Small tensors,
the low-rank / latent projections, norms, the router and the indexer stay replicated. A dimension that the axis
size does not divide stays replicated (logged), so any mesh is valid. XLA inserts the collectives (GSPMD).
"""

from __future__ import annotations

import logging
import re

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

log = logging.getLogger("kimi_jax.sharding")

MODEL = "model"

# (pattern on the parameter path, dimension split over "model"); first match wins; no match = replicated.
RULES: tuple[tuple[str, int], ...] = (
    (r"^embed_tokens$", 0),
    (r"^lm_head\.kernel$", 1),
    (r"self_attn\.indexer\.", -1),  # replicated: the indexer's score is a sum over its heads
    (r"self_attn\.(q_proj|k_proj|v_proj|g_proj|f_b_proj|g_b_proj|b_proj|q_b_proj)\.kernel$", 1),
    (r"self_attn\.(q_conv1d|k_conv1d|v_conv1d)$", 1),
    (r"self_attn\.(A_log|dt_bias)$", 0),
    (r"self_attn\.(k_up_proj|v_up_proj)$", 1),
    (r"self_attn\.o_proj\.kernel$", 0),
    (r"block_sparse_moe\.(w1|w2|w3)$", 0),
    (r"(mlp|shared_experts)\.(gate_proj|up_proj)\.kernel$", 1),
    (r"(mlp|shared_experts)\.down_proj\.kernel$", 0),
)
_COMPILED = tuple((re.compile(p), d) for p, d in RULES)


def param_partition_spec(path: str, shape, model_size: int) -> P:
    """The PartitionSpec for one parameter on a mesh whose "model" axis has `model_size` devices."""
    for pattern, dim in _COMPILED:
        if pattern.search(path):
            if dim < 0 or model_size == 1:
                return P()
            if shape[dim] % model_size:
                log.info("replicating %s: dim %d of %s does not split %d ways", path, dim, tuple(shape), model_size)
                return P()
            spec = [None] * len(shape)
            spec[dim] = MODEL
            return P(*spec)
    return P()


def _path_name(path) -> str:
    parts = (str(getattr(p, "key", getattr(p, "idx", getattr(p, "name", "")))) for p in path)
    return ".".join(x for x in parts if x and x != "value")


def shard_params(state, mesh):
    """Place every leaf of an NNX parameter State on `mesh` by the rules. Returns the placed State."""
    model_size = mesh.shape[MODEL]

    def place(path, leaf):
        spec = param_partition_spec(_path_name(path), leaf.shape, model_size)
        return jax.device_put(leaf, NamedSharding(mesh, spec))

    return jax.tree_util.tree_map_with_path(place, state)


def batch_sharding(mesh, ndim: int, batch: int):
    """Inputs split their batch over "data" when it divides, else stay replicated."""
    if batch % mesh.shape["data"] == 0:
        return NamedSharding(mesh, P("data", *([None] * (ndim - 1))))
    return NamedSharding(mesh, P())
