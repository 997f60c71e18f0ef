"""Mesh construction and logical-axis partition rules (DESIGN.md: sharding by names)."""

from .mesh import MeshError, make_mesh, parse_mesh_spec
from .rules import param_partition_spec, shard_params

__all__ = ["MeshError", "make_mesh", "parse_mesh_spec", "param_partition_spec", "shard_params"]
