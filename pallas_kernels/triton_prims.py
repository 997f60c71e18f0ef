"""Primitives with their own Pallas Triton lowering, each with a jnp twin for everything else: elementwise inline
PTX (`inline_asm_primitive`, `fp8_e4m3_to_f16`) and an fp8 tensor-core dot with fast accumulation (`fp8_dot_nt`).

`inline_asm_primitive` builds a JAX primitive that the Pallas Triton lowering turns into one
`tt.elementwise_inline_asm` op, and that every other lowering (interpret mode on CPU, plain XLA) computes with a
jnp function giving the same bits. So a kernel body calls it unconditionally and interpret-mode tests check the
same program the GPU runs, up to the PTX itself (the device tests check that).

Why not `pallas.triton.elementwise_inline_asm`: its lowering (jax 0.10) wraps a multi-result op's results as one
value, and it always declares the asm pure. `pure=False` matters: Triton may rematerialise a pure elementwise op
once per consumer layout (for two dots: once per dot operand, each reading its input from shared memory in that
operand's layout), but never an op with side effects — so a non-pure conversion runs once per element and its
result reaches the dots through one shared-memory staging (see `fp8_e4m3_to_f16`). Uses JAX's Triton lowering
registry and primitive internals (private API; present in jax 0.10.x and 0.11.x).
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax._src.lib.mlir import ir


def _primitive(name: str, abstract: Callable, triton_rule: Callable, reference: Callable, multiple_results: bool):
    """A primitive with `abstract` as its abstract evaluation, `triton_rule(ctx, *args)` as its Pallas Triton
    lowering and `reference` (jnp) as its lowering everywhere else."""
    from jax._src import core as jax_core
    from jax._src import dispatch
    from jax._src.pallas.triton import lowering as tt_lowering
    from jax.interpreters import mlir

    prim = jax_core.Primitive(name)
    prim.multiple_results = multiple_results
    prim.def_abstract_eval(abstract)
    tt_lowering.register_lowering(prim)(triton_rule)
    mlir.register_lowering(prim, mlir.lower_fun(reference, multiple_results=multiple_results))
    prim.def_impl(functools.partial(dispatch.apply_primitive, prim))
    return prim


def inline_asm_primitive(name: str, ptx: str, constraints: str, packed_element: int, out_dtypes: Sequence,
                         reference: Callable, pure: bool = True, check: Callable | None = None):
    """A primitive `p` with `p.bind(*args) -> list of len(out_dtypes) arrays` (args' common shape): the Triton
    lowering runs `ptx` (`constraints` in Triton's inline-asm form, `packed_element` elements per register);
    elsewhere `reference(*args)` (a list of arrays, same bits) runs. `check(*avals)` may raise on bad inputs."""
    from jax._src import core as jax_core
    from jax._src.lib.triton import dialect as tt_dialect
    from jax.interpreters import mlir

    def abstract(*avals):
        if check is not None:
            check(*avals)
        return [jax_core.ShapedArray(avals[0].shape, d) for d in out_dtypes]

    def triton_rule(ctx, *args):
        types = [mlir.aval_to_ir_type(ctx.context.mlir_ctx, a) for a in ctx.avals_out]
        res = tt_dialect.elementwise_inline_asm(types, ptx, constraints=constraints, pure=pure,
                                                packed_element=packed_element, args=list(args))
        return [res] if len(types) == 1 else list(res)

    return _primitive(name, abstract, triton_rule, lambda *a: list(reference(*a)), multiple_results=True)


# Four e4m3 bytes (one 32-bit register) -> four f16 (two registers): the hardware conversion, two per instruction
# (also the Mosaic GPU sparse MLA kernel's logits-operand conversion, `mla.sparse_mgpu`).
CVT_E4M3X4_F16_PTX = """{
.reg .b16 e4lo, e4hi;
mov.b32 {e4lo, e4hi}, $2;
cvt.rn.f16x2.e4m3x2 $0, e4lo;
cvt.rn.f16x2.e4m3x2 $1, e4hi;
}"""


def _check_fp8(x):
    if x.dtype != jnp.uint8:
        raise ValueError(f"fp8_e4m3_to_f16 takes float8_e4m3fn values or their uint8 bits, got {x.dtype}")


@functools.lru_cache(maxsize=None)
def _fp8_to_f16_p():
    ref = lambda x: [jax.lax.bitcast_convert_type(x, jnp.float8_e4m3fn).astype(jnp.float16)]  # noqa: E731
    return inline_asm_primitive("fp8_e4m3_to_f16_once", CVT_E4M3X4_F16_PTX, "=r,=r,r", 4, [jnp.float16], ref,
                                pure=False, check=_check_fp8)


def fp8_e4m3_to_f16(x):
    """e4m3 values (float8_e4m3fn or their uint8 bits) `[...]` -> float16 `[...]` (exact: every e4m3 value is an
    f16), converted ONCE per element inside a Triton kernel however many dots read the result (a non-pure asm op:
    Triton cannot duplicate it into each dot's operand layout; see the module docstring)."""
    if x.dtype == jnp.float8_e4m3fn:
        x = jax.lax.bitcast_convert_type(x, jnp.uint8)
    return _fp8_to_f16_p().bind(x)[0]


# ------------------------------------------------------------------------------------------------ fp8 dot

@functools.lru_cache(maxsize=None)
def _fp8_dot_nt_p():
    from jax._src import core as jax_core
    from jax._src.lib.triton import dialect as tt_dialect
    from jax._src.pallas.triton import lowering as tt_lowering

    def abstract(a, b, *acc):
        fp8 = {a.dtype, b.dtype} == {jnp.dtype(jnp.float8_e4m3fn)}
        if (a.ndim, b.ndim) != (2, 2) or a.shape[1] != b.shape[1] or not fp8:
            raise ValueError(f"fp8_dot_nt takes a [M, K] and b [N, K] float8_e4m3fn, got {a.dtype}{list(a.shape)} "
                             f"and {b.dtype}{list(b.shape)}")
        out = jax_core.ShapedArray((a.shape[0], b.shape[0]), jnp.float32)
        if acc and (acc[0].shape != out.shape or acc[0].dtype != jnp.float32):
            raise ValueError(f"fp8_dot_nt's acc must be float32 {list(out.shape)}, got {acc[0].dtype}"
                             f"{list(acc[0].shape)}")
        return out

    def triton_rule(ctx, a, b, *acc):
        m, n = ctx.avals_out[0].shape
        c = acc[0] if acc else tt_lowering._zeros(ir.RankedTensorType.get([m, n], ir.F32Type.get()))
        return tt_dialect.dot(a, tt_dialect.trans(b, [1, 0]), c, max_num_imprecise_acc=FP8_DOT_IMPRECISE_ACC)

    def reference(a, b, *acc):
        d = jax.lax.dot_general(a.astype(jnp.float32), b.astype(jnp.float32), (((1,), (1,)), ((), ())),
                                precision=jax.lax.Precision.HIGHEST)
        return d + acc[0] if acc else d

    return _primitive("fp8_dot_nt_fast_accum", abstract, triton_rule, reference, multiple_results=False)


# Triton runs an fp8 dot on Hopper's wgmma only when it may accumulate in the tensor core's reduced-precision
# accumulator for at least 32 products (`maxNumImpreciseAcc` ≥ 32; below that it falls back to mma.sync on f16
# copies of both operands). This many products before a full fp32 add: the whole dot (Triton's fp8 "fast
# accumulation"); the accumulator keeps ≈ 14 significant bits over a 128-product dot.
FP8_DOT_IMPRECISE_ACC = 1 << 30


def fp8_dot_nt(a, b, acc=None):
    """a `[M, K]` · b `[N, K]`ᵀ (+ acc `[M, N]` float32) -> `[M, N]` float32 for float8_e4m3fn a and b: in a
    Pallas Triton kernel one tensor-core dot on the fp8 values (wgmma where Triton can: M ≥ 64 per warpgroup) with
    fast accumulation, `acc` its accumulator input; elsewhere the exact fp32 product (the reference). Pallas's own
    dot lowering cannot ask for fast accumulation."""
    return _fp8_dot_nt_p().bind(a, b) if acc is None else _fp8_dot_nt_p().bind(a, b, acc)
