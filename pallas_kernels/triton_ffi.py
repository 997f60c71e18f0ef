"""jax-triton launches as jaxlib's typed-FFI Triton call, which XLA's command buffers (CUDA graphs) can capture.

jax-triton 0.3.1 lowers each launch to the legacy custom call `triton_kernel_call` (API version 2, the kernel-call
proto zlib-compressed in `backend_config`). XLA keeps legacy custom calls out of its command buffers, and on every
call jaxlib's handler finds its kernel by hashing that whole compressed proto: host time per launch, which short
kernels pay in full (docs/gpu.md, docs/performance.md). jaxlib also registers `triton_kernel_call_ffi` (typed FFI:
the same proto as an `opaque` attribute, the kernel loaded once in an initialize step). JAX's own Pallas Triton
lowering emits that call, and XLA can record it into a command buffer.

`install()` re-registers jax-triton's CUDA lowering. It runs jax-triton's own lowering (which compiles the kernel
and builds the proto), then replaces the legacy op it emitted by the FFI op, with the same operands, results,
layouts and aliases. It does this only where jaxlib registers the FFI target; elsewhere, and on ROCm, the legacy
call stays. `USE_FFI = False` keeps the legacy call for programs lowered afterwards, so a benchmark can time both.
"""

from __future__ import annotations

import functools
import logging
import os

log = logging.getLogger("pallas_kernels.triton_ffi")

FFI_TARGET = "triton_kernel_call_ffi"
LEGACY_TARGET = "triton_kernel_call"
# what programs lowered from now on emit (read at lowering time); KIMI_JAX_TRITON_LEGACY_CALL=1 starts it False
USE_FFI = os.environ.get("KIMI_JAX_TRITON_LEGACY_CALL", "0") in ("", "0", "false", "False")


def ffi_target_registered() -> bool:
    """Whether this jaxlib's CUDA plugin registers the typed-FFI Triton call."""
    try:
        from jax._src.lib import gpu_triton
    except ImportError:
        return False
    cuda = getattr(gpu_triton, "_cuda_triton", None)
    try:
        return cuda is not None and FFI_TARGET in cuda.registrations()
    except Exception:  # noqa: BLE001  (an older plugin without registrations())
        return False


def as_ffi_call(legacy_op, name: str):
    """Replace the legacy custom call `legacy_op` (target "triton_kernel_call", `backend_config` = the compressed
    kernel-call proto) by the typed-FFI call on the same operands, with the same result types, layouts, aliases and
    side-effect flag. Must run at the legacy op's insertion point, before its results have users. Returns the new
    op's results."""
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir

    op = legacy_op.operation
    attrs = op.attributes
    target = ir.StringAttr(attrs["call_target_name"]).value
    if target != LEGACY_TARGET:
        raise ValueError(f"expected a {LEGACY_TARGET!r} custom call, got {target!r}")
    opaque = ir.StringAttr(attrs["backend_config"]).value_bytes
    extra = {k: attrs[k] for k in ("operand_layouts", "result_layouts", "output_operand_aliases") if k in attrs}
    side_effect = "has_side_effect" in attrs and ir.BoolAttr(attrs["has_side_effect"]).value
    new = mlir.custom_call(FFI_TARGET, result_types=[r.type for r in op.results], operands=list(op.operands),
                           backend_config=dict(name=ir.StringAttr.get(name), opaque=ir.StringAttr.get(opaque)),
                           has_side_effect=side_effect, extra_attributes=extra)
    op.erase()
    return new.results


@functools.lru_cache(maxsize=None)
def install(jax_triton_module) -> bool:
    """Lower jax-triton's CUDA launches to the FFI call (once per process) where jaxlib has it; returns whether."""
    if not ffi_target_registered():
        log.info("jaxlib registers no %s: native Triton launches stay legacy custom calls (outside XLA's command "
                 "buffers)", FFI_TARGET)
        return False
    from jax._src.interpreters import mlir

    lib = jax_triton_module.triton_lib
    legacy_rule = functools.partial(lib.triton_kernel_call_lowering, lib.get_cuda_backend)

    def rule(ctx, *args, **params):
        results = legacy_rule(ctx, *args, **params)
        if not USE_FFI or not results:
            return results
        name = params.get("name") or getattr(params.get("fn"), "__name__", "triton_kernel")
        return as_ffi_call(results[0].owner, name)

    mlir.register_lowering(lib.triton_kernel_call_p, rule, platform="cuda")
    return True
