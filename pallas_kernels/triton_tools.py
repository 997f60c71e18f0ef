"""Inspecting what the Pallas Triton lowering produces, without a GPU (used by tests and bench/triton_regs.py)."""

from __future__ import annotations

import jax


def lowered_triton_modules(fn, *args):
    """Lower `fn(*args)` for CUDA and return the Triton MLIR modules that the Pallas Triton lowering produced
    (captured at `lower_jaxpr_to_triton_module`), as (kernel name, module) pairs in launch order. `args` may be
    `jax.ShapeDtypeStruct`s."""
    from jax._src.pallas.triton import lowering as TL
    mods = []
    orig = TL.lower_jaxpr_to_triton_module

    def capture(*a, **k):
        r = orig(*a, **k)
        mods.append(r.module)
        return r

    TL.lower_jaxpr_to_triton_module = capture
    try:
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        TL.lower_jaxpr_to_triton_module = orig
    return [(str(m.operation.regions[0].blocks[0].operations[0].attributes["sym_name"]).strip('"'), m) for m in mods]
