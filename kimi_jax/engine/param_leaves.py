"""Compiled programs that take a model's parameters as a flat list of arrays.

Calling a compiled program with an ``nnx.State`` flattens it in Python, one Variable at a time, on every call; a
flat list of arrays is flattened in C++ (docs/performance.md, "host work per program call"). ``ParamLeaves`` holds
that list once and rebuilds the ``nnx.State`` inside the traced function, where it costs nothing per call.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax


class ParamLeaves:
    """A model's parameters as ``leaves`` (a flat list of arrays, in ``jax.tree.leaves`` order) and the tree
    structure that rebuilds them."""

    def __init__(self, params: Any):
        """``params``: the model's ``nnx.State`` (or any pytree of arrays)."""
        self.tree = jax.tree.structure(params)
        self.leaves = jax.tree.leaves(params)

    def taking(self, fn: Callable) -> Callable:
        """``fn(params, *args)`` as ``g(leaves, *args)``: the same function over the flat list, for ``jax.jit``
        (argument numbers such as ``donate_argnums`` keep their meaning)."""
        tree = self.tree
        return functools.wraps(fn)(lambda leaves, *args: fn(jax.tree.unflatten(tree, leaves), *args))
