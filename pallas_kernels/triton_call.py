"""Launching a native Triton kernel (`@jit` below) from JAX, one signature for both places it runs:

* on a GPU, `jax_triton.triton_call` (a custom call: the kernel is compiled for the device when the program is
  lowered; CUDA or ROCm, whichever Triton backend the device has);
* on the host, Triton's interpreter (CPU tests), through `jax.pure_callback` with torch CPU tensors, so the JAX code
  that prepares a kernel's inputs and reads its outputs is the same code in both. The interpreter needs
  `TRITON_INTERPRET=1` in the environment before triton is imported (tests/conftest.py sets it where JAX runs on
  CPU): only then are Triton's own library functions (`tl.zeros`, `tl.max`, ...) interpretable too.

The kernel modules import `triton` / `tl` from here, so the package imports where triton is not installed (CPU CI):
`jit` then returns the plain function and `available()` is False. jax-triton imports only with a GPU jaxlib (it
reads the compute capability at import), so it is imported at the first GPU launch, never at module import.
Versions (pyproject's [gpu] extra, docs/gpu.md): jax-triton 0.3.1 with triton 3.6; 0.4.x needs triton 3.7.

Vendor-specific code paths (inline PTX) are picked at compile time by a constexpr whose value is `ON_NVIDIA`: the
launcher resolves it per compile target (True for CUDA; False for ROCm and the interpreter, which cannot run PTX).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from . import triton_ffi

log = logging.getLogger("pallas_kernels.triton_call")

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU CI without triton: the kernel modules import, nothing launches
    triton = tl = None


def jit(fn):
    """`triton.jit` where triton is installed; else `fn` itself (kept importable, never launched)."""
    return fn if triton is None else triton.jit(fn)


def interpreting() -> bool:
    """Whether triton was imported in interpreter mode (`TRITON_INTERPRET=1`): `@jit` kernels run on the host."""
    return triton is not None and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")


@functools.lru_cache(maxsize=None)
def _jax_triton():
    try:
        import jax_triton
    except ImportError:
        return None
    return jax_triton


def available() -> bool:
    """Whether `call` can launch on a GPU here: triton, and jax-triton (which imports only with a GPU jaxlib)."""
    return triton is not None and _jax_triton() is not None


class _OnNvidia:
    """The value of a constexpr that `call` resolves per compile target: True where the kernel is compiled for an
    NVIDIA GPU (inline PTX allowed), False for ROCm and Triton's interpreter. A kernel never sees this object."""

    def __repr__(self) -> str:
        return "ON_NVIDIA"


ON_NVIDIA = _OnNvidia()


def _for_target(constexprs: dict, nvidia: bool) -> dict:
    return {k: (nvidia if v is ON_NVIDIA else v) for k, v in constexprs.items()}


@functools.lru_cache(maxsize=None)
def _device_is_nvidia() -> bool:
    """Whether the GPU jax-triton compiles for is NVIDIA's: from JAX's GPU client (its platform and version name
    CUDA or ROCm), else from Triton's active driver. Where neither tells, the portable path (no PTX) is taken and a
    warning says so: on an NVIDIA GPU that path is slower (the MXFP4 grouped matmul's arithmetic decode: 3-8x)."""
    try:
        client = jax.devices("gpu")[0].client
        name = f"{client.platform} {client.platform_version}".lower()
        if "cuda" in name or "nvidia" in name:
            return True
        if "rocm" in name or "hip" in name:
            return False
    except RuntimeError:  # no GPU backend in JAX: ask Triton
        pass
    try:
        return triton.runtime.driver.active.get_current_target().backend == "cuda"
    except Exception as e:  # noqa: BLE001  (no driver: the portable path, which runs everywhere)
        log.warning("cannot tell whether the GPU is NVIDIA's (%s: %s); native Triton kernels take their portable "
                    "path, without inline PTX", type(e).__name__, e)
        return False


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def call(*args, kernel, out_shape, grid, interpret: bool = False, num_warps: int = 4, num_stages: int = 3,
         input_output_aliases: dict | None = None, name: str = "", **constexprs):
    """Run `kernel[grid](*args, *outputs, **constexprs)` -> the outputs (a list when `out_shape` is a sequence).

    args: jax arrays (passed as pointers, row-major) and Python ints / floats (scalar arguments; jax-triton turns an
    int equal to 1 into a constant). out_shape: `jax.ShapeDtypeStruct`s; their buffers follow the inputs.
    input_output_aliases {input index: output index}: the output starts as that input's buffer (updated in place).
    interpret: Triton's interpreter on the host (needs `interpreting()`); outputs not aliased start as NaN (floats)
    or their largest value (integers), so an element the kernel fails to write shows in a comparison.
    A constexpr given as `ON_NVIDIA` becomes True or False for the target the kernel is compiled for."""
    many = isinstance(out_shape, (list, tuple))
    outs = list(out_shape) if many else [out_shape]
    aliases = dict(input_output_aliases or {})
    if interpret:
        res = _interpret(args, kernel, outs, grid, aliases, _for_target(constexprs, nvidia=False))
    else:
        res = _gpu_launch(args, kernel=kernel, out_shape=outs, grid=tuple(grid), num_warps=num_warps,
                          num_stages=num_stages, input_output_aliases=aliases, name=name, constexprs=constexprs)
    return list(res) if many else res[0]


def _gpu_launch(args, *, kernel, out_shape, grid, num_warps, num_stages, input_output_aliases, name, constexprs):
    """The jax-triton custom call (tests/test_triton_compile.py replaces this to collect launches and compile them
    for a GPU target on a host without one)."""
    jt = _jax_triton()
    if jt is None:
        raise RuntimeError("native Triton kernels need jax-triton on a GPU (pip install 'kimi_jax[gpu]'); "
                           "on CPU run them with interpret=True under TRITON_INTERPRET=1")
    triton_ffi.install(jt)  # CUDA launches as the typed-FFI call that XLA's command buffers capture
    return jt.triton_call(*args, kernel=kernel, out_shape=out_shape, grid=grid, num_warps=num_warps,
                          num_stages=num_stages, input_output_aliases=input_output_aliases, name=name,
                          **_for_target(constexprs, _device_is_nvidia()))


# Triton's pointer type names for JAX dtypes (as jax-triton spells them), for compiling a launch ahead of time.
_TRITON_PTR = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16", "float8_e4m3fn": "fp8e4nv",
               "int32": "i32", "int64": "i64", "uint8": "u8", "int8": "i8", "bool": "i1"}


def compile_launch(target, args, *, kernel, out_shape, num_warps, num_stages, constexprs, **_):
    """Compile one launch (the arguments `_gpu_launch` receives; arrays may be `jax.ShapeDtypeStruct`s) for a
    `triton.backends.compiler.GPUTarget` — e.g. ("cuda", 90, 32) or ("hip", "gfx942", 64) — without a device, as
    jax-triton would: pointers 16-byte aligned, Python ints as i32 scalars (1 as a constant). Returns Triton's
    compiled kernel (its `.asm` holds ttir / ttgir / llir / ptx or amdgcn, and its `.metadata` the shared memory)."""
    from triton.compiler import ASTSource

    names = kernel.arg_names
    signature, consts, attrs = {}, _for_target(constexprs, target.backend == "cuda"), {}
    flat = list(args) + list(out_shape)
    for i, a in enumerate(flat):
        if isinstance(a, bool) or (isinstance(a, int) and a == 1):
            consts[names[i]] = a
        elif isinstance(a, int):
            signature[names[i]] = "i32"
        elif isinstance(a, float):
            signature[names[i]] = "fp32"
        else:
            signature[names[i]] = "*" + _TRITON_PTR[jnp.dtype(a.dtype).name]
            attrs[(i,)] = [["tt.divisibility", 16]]
    for k in consts:
        signature[k] = "constexpr"
    src = ASTSource(fn=kernel, signature=signature, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=target, options=dict(num_warps=num_warps, num_stages=num_stages))


# ------------------------------------------------------------------------------------------------ interpreter

def _torch_dtypes():
    import torch

    return {jnp.dtype(jnp.bfloat16): (np.uint16, torch.bfloat16),
            jnp.dtype(jnp.float8_e4m3fn): (np.uint8, torch.float8_e4m3fn),
            jnp.dtype(jnp.float8_e5m2): (np.uint8, torch.float8_e5m2)}


def _to_torch(x: np.ndarray):
    import torch

    special = _torch_dtypes().get(x.dtype)
    if special is None:
        return torch.from_numpy(np.array(x))
    return torch.from_numpy(np.array(x).view(special[0])).view(special[1])


def _from_torch(t, dtype) -> np.ndarray:
    dtype = jnp.dtype(dtype)
    special = _torch_dtypes().get(dtype)
    if special is None:
        return t.numpy()
    import torch

    return t.view({np.uint16: torch.int16, np.uint8: torch.uint8}[special[0]]).numpy().view(dtype)


@functools.lru_cache(maxsize=None)
def _interpreter_bf16_dots() -> None:
    """Triton's interpreter (3.8) keeps bf16 values as their uint16 bits and `tl.dot` multiplies those bits as
    integers. Widen bf16 dot operands to float32 first (exact), which is what the tensor cores multiply."""
    from triton.runtime import interpreter as ti

    orig = ti.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        def widen(x):
            if x.dtype.scalar != tl.bfloat16:
                return x
            bits = (x.data.astype(np.uint32) << 16).view(np.float32)
            return ti.TensorHandle(bits, tl.float32)

        return orig(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    ti.InterpreterBuilder.create_dot = create_dot


@functools.lru_cache(maxsize=None)
def _interpreter_bf16_rounding() -> None:
    """Triton's interpreter (3.8) converts float32 -> bf16 by cutting the mantissa; a GPU rounds to nearest even.
    A kernel that keeps bf16 intermediates drifts by a biased 2^-8 per rounding there (KDA prefill: 1.3e-2 relative
    RMS on bf16 inputs against a 5e-3 bar), so round to nearest even here too (NaN stays NaN)."""
    from triton.runtime import interpreter as ti

    orig = ti.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return orig(self, src, dst_type)
        x = np.asarray(src.data, np.float32)
        bits = x.view(np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        return ti.TensorHandle(np.where(np.isnan(x), np.uint16(0x7FC0), rounded), tl.bfloat16)

    ti.InterpreterBuilder.cast_impl = cast_impl


@functools.lru_cache(maxsize=None)
def _interpreter_scalar_index() -> None:
    """Triton's interpreter (3.6) turns a scalar tensor into a Python int (a loop bound computed in the kernel:
    `range(0, n_live)`) by `int(data)`, and holds some scalars as 1-element arrays of shape (1,), which NumPy ≥ 2.4
    refuses to convert ("only 0-dimensional arrays can be converted to Python scalars"). Convert through the one
    element instead, as NumPy did before."""
    from triton.runtime import interpreter as ti

    orig = ti._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    ti._patch_lang_tensor = patch_lang_tensor


# Triton's interpreter patches `triton.language` for the duration of a launch and restores it afterwards: two launches
# at once (the host callbacks of a program over several CPU devices, e.g. a shard_map on a fake mesh, run on the
# devices' threads) undo each other's patches. One interpreted launch at a time.
_INTERPRETER_LOCK = threading.Lock()


def _interpret(args: Sequence, kernel, outs, grid, aliases, constexprs):
    if not interpreting():
        raise RuntimeError("interpret=True runs Triton's interpreter: set TRITON_INTERPRET=1 before triton is "
                           "imported (tests/conftest.py does on CPU)")
    _interpreter_bf16_dots()
    _interpreter_bf16_rounding()
    _interpreter_scalar_index()
    arrays = [i for i, a in enumerate(args) if not isinstance(a, (bool, int, float))]

    def host(*host_arrays):
        import torch

        vals = list(args)
        for i, a in zip(arrays, host_arrays):
            vals[i] = _to_torch(np.asarray(a))
        bufs = []
        for k, o in enumerate(outs):
            src = next((i for i, j in aliases.items() if j == k), None)
            if src is not None:
                bufs.append(vals[src].clone())
            else:
                kind = jnp.dtype(o.dtype)
                fill = np.nan if jnp.issubdtype(kind, jnp.floating) else np.iinfo(kind).max
                bufs.append(_to_torch(np.full(o.shape, fill, kind)))
        with _INTERPRETER_LOCK:
            kernel[tuple(grid)](*vals, *bufs, **constexprs)
        return [_from_torch(b, o.dtype) for b, o in zip(bufs, outs)]

    shapes = [jax.ShapeDtypeStruct(o.shape, o.dtype) for o in outs]
    return jax.pure_callback(host, shapes, *[args[i] for i in arrays])
