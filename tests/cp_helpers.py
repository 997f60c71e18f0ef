"""Shared by the context-parallel tests and the 8-fake-device scripts they run in subprocesses."""

from __future__ import annotations

import numpy as np

COLLECTIVES = ("all_gather", "psum", "pmax", "ppermute", "all_to_all", "reduce_scatter")


def collective_payload_bytes(jaxpr) -> int:
    """Bytes handed to collectives in a traced program (operands of every collective, nested jaxprs included):
    what the context-parallel accounting (`decode_comm_bytes*`) must predict exactly."""
    total = 0
    for eqn in jaxpr.eqns:
        if any(eqn.primitive.name.startswith(c) for c in COLLECTIVES):
            total += sum(int(np.prod(a.aval.shape)) * a.aval.dtype.itemsize for a in eqn.invars)
        for param in eqn.params.values():
            for sub in (param if isinstance(param, (tuple, list)) else (param,)):
                if hasattr(sub, "eqns"):
                    total += collective_payload_bytes(sub)
                elif hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
                    total += collective_payload_bytes(sub.jaxpr)
    return total
