"""Mesh construction and logical-axis partition rules (docs/architecture.md: sharding by names); expert and context
parallelism (`sharding.expert_parallel`, `sharding.context_parallel`)."""

from .mesh import MeshError, expert_axes, make_mesh, parse_mesh_spec
from .rules import mesh_partition_spec, param_partition_spec, shard_params

__all__ = ["MeshError", "expert_axes", "make_mesh", "parse_mesh_spec", "mesh_partition_spec",
           "param_partition_spec", "shard_params"]
