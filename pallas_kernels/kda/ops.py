"""Public entry point of the KDA ops: `chunk` (prefill, optionally varlen) and `recurrent` (decode against a state
pool). Both pick a backend in one place (`resolve_backend`):

  "auto"       → the GPU kernels (native Triton through jax-triton) on a GPU where jax-triton imports, the TPU kernel
                 (Pallas Mosaic TPU) on a TPU, else the jnp reference; the platform is `platform=` ("cpu" | "tpu" |
                 "gpu" / "cuda") or, when None, that of `jax.default_backend()` at trace time (pass it when exporting
                 for another platform);
  "gpu", "tpu", "reference"   → that path (`gpu_triton.py`, `tpu.py`, `reference.py`); "gpu_interpret" → the Triton
                 kernels in Triton's interpreter, "tpu_interpret" → the TPU kernel in Pallas interpret mode (CPU
                 tests); "triton" / "triton_interpret" are other names of "gpu" / "gpu_interpret".

Layout as in `reference.py`: q, k `[B, T, H, dk]` (L2-normalised), v `[B, T, H, dv]`, g `[B, T, H, dk]` log-decay ≤ 0,
beta `[B, T, H]`, states `[., H, dk, dv]` float32; `scale` (default dk^-0.5) multiplies q.
Gate fusion: pass `gate_form` ("lower_bound" | "plain") with `A_log [H]` and `dt_bias [H*dk]`; `g` is then the raw
forget projection f and the decay is computed inside the kernel (reference.gate is the definition).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

# the package's own modules by their full name: `from . import x` would make this module import the package, whose
# __init__ imports this module (tests/test_import_layers.py counts that as a cycle)
import pallas_kernels.kda.chunk_math as chunk_math
import pallas_kernels.kda.gpu_triton as gpu_triton
import pallas_kernels.kda.reference as reference
import pallas_kernels.kda.tpu as tpu

from ..platform import resolve_platform

BACKENDS = ("reference", "gpu", "tpu", "gpu_interpret", "tpu_interpret", "triton", "triton_interpret")
_ALIASES = {"triton": "gpu", "triton_interpret": "gpu_interpret"}
# GPU: "auto" takes the Triton kernels. The model-level GPU check (tests/test_kernel_path.py, `gpu` case, and
# bench/kda_gpu_diag.py "model") runs both paths with IEEE fp32 products: under XLA's TF32 default the other layers'
# roundings and the tiny model's top-k selections amplify the kernels' 1e-6 difference (logit differences
# of 0.28–0.31 at TF32 were that, not the kernels).
_PLATFORM_TO_BACKEND = {"gpu": "gpu", "tpu": "tpu"}


def resolve_backend(backend: str = "auto", platform: Optional[str] = None) -> str:
    """The single place where a backend is chosen. "auto" takes the kernel of `platform` (None: the default
    backend's platform); on "gpu" it falls back to the reference where jax-triton cannot launch (no triton, or a
    jaxlib without GPU support, e.g. exporting for CUDA from a CPU host). Other names are resolved ("triton" ->
    "gpu")."""
    if backend == "auto":
        backend = _PLATFORM_TO_BACKEND.get(resolve_platform(platform), "reference")
        if backend == "gpu" and not gpu_triton.available():
            backend = "reference"
    if backend not in BACKENDS:
        raise ValueError(f"unknown KDA backend {backend!r}; expected 'auto' or one of {BACKENDS}")
    return _ALIASES.get(backend, backend)


def _pow2(n: int) -> bool:
    return n >= 16 and (n & (n - 1)) == 0


def _gpu_shapes_ok(dk: int, dv: int) -> bool:
    return _pow2(dk) and _pow2(dv)


def _check(q, k, v, g, beta):
    B, T, H, dk = q.shape
    if k.shape != q.shape or g.shape != q.shape:
        raise ValueError(f"q, k, g must share shape [B, T, H, dk]; got {q.shape}, {k.shape}, {g.shape}")
    if v.shape[:3] != (B, T, H) or beta.shape != (B, T, H):
        raise ValueError(f"v must be [B, T, H, dv] and beta [B, T, H]; got {v.shape}, {beta.shape}")


def _check_chunk_layout(B, T, H, dk, dv, initial_state, cu_seqlens):
    """The packed layout and the initial states, checked the same way for every backend (the kernels' chunk table
    refuses a bad concrete cu_seqlens; the reference would silently run it)."""
    if cu_seqlens is None:
        n = B
    else:
        if B != 1:
            raise ValueError(f"cu_seqlens needs the packed layout with B = 1; got B = {B}")
        if isinstance(cu_seqlens, jax.core.Tracer):
            n = cu_seqlens.shape[0] - 1
        else:
            cu = np.asarray(cu_seqlens)
            if (cu.ndim != 1 or cu.shape[0] < 2 or cu[0] != 0 or np.any(np.diff(cu) < 0) or cu[-1] != T):
                raise ValueError(f"cu_seqlens must be non-decreasing, start at 0 and end at T = {T}; got {cu}")
            n = cu.shape[0] - 1
    if initial_state is not None and tuple(initial_state.shape) != (n, H, dk, dv):
        what = "N = len(cu_seqlens) - 1" if cu_seqlens is not None else "B"
        raise ValueError(f"initial_state must be [{what} = {n}, H = {H}, dk = {dk}, dv = {dv}]; "
                         f"got {tuple(initial_state.shape)}")


def _gate_kwargs(A_log, dt_bias, gate_form, lower_bound):
    if gate_form is None:
        return {}
    if A_log is None or dt_bias is None:
        raise ValueError("gate_form needs A_log [H] and dt_bias [H*dk]")
    return dict(A_log=A_log, dt_bias=dt_bias, gate_form=gate_form, lower_bound=lower_bound)


def _reference_gate(g, H, dk, A_log, dt_bias, gate_form, lower_bound):
    if gate_form is None:
        return g
    return reference.gate(g, jnp.asarray(A_log).reshape(H), jnp.asarray(dt_bias).reshape(H, dk), gate_form,
                          lower_bound)


def reference_varlen(q, k, v, g, beta, cu_seqlens, initial_state=None, scale=None):
    """The varlen definition (token recurrence with restarts); see reference.recurrent_varlen."""
    return reference.recurrent_varlen(q, k, v, g, beta, cu_seqlens, initial_state, scale=scale)


def chunk(q, k, v, g, beta, initial_state=None, scale=None, cu_seqlens=None, backend: str = "auto", *,
          A_log=None, dt_bias=None, gate_form: Optional[str] = None, lower_bound: float = -5.0,
          platform: Optional[str] = None):
    """Chunked prefill.

    Without `cu_seqlens`: B independent sequences of length T; `initial_state` `[B, H, dk, dv]` or None; returns
    (o `[B, T, H, dv]` in v.dtype, final state `[B, H, dk, dv]` float32).
    With `cu_seqlens` `[N+1]` (B must be 1; sequences packed along T; state restarts at each start): `initial_state`
    `[N, H, dk, dv]` or None; returns (o `[1, T, H, dv]`, final states `[N, H, dk, dv]`). cu_seqlens may be a numpy
    array (exact chunk count) or a traced array (static upper bound on chunks).
    """
    _check(q, k, v, g, beta)
    B, T, H, dk = q.shape
    dv = v.shape[-1]
    _check_chunk_layout(B, T, H, dk, dv, initial_state, cu_seqlens)
    be = resolve_backend(backend, platform)
    if (be.startswith("gpu") and not _gpu_shapes_ok(dk, dv)) or B * T == 0:
        be = "reference"  # no tokens: nothing for a kernel to do (the final states are the initial ones)
    if cu_seqlens is None:
        cu = chunk_math.uniform_cu_seqlens(B, T)
        flat = lambda a: a.reshape((1, B * T) + a.shape[2:])
        args = tuple(map(flat, (q, k, v, g, beta)))
    else:
        cu = cu_seqlens
        args = (q, k, v, g, beta)

    if be == "reference":
        gg = _reference_gate(g, H, dk, A_log, dt_bias, gate_form, lower_bound)
        if cu_seqlens is None:
            return reference.chunk(q, k, v, gg, beta, initial_state, scale=scale)
        return reference.recurrent_varlen(q, k, v, gg, beta, cu, initial_state, scale=scale)

    interpret = be.endswith("_interpret")
    if be.startswith("gpu"):
        o, s = gpu_triton.chunk(*args, cu, initial_state, scale, interpret=interpret,
                                **_gate_kwargs(A_log, dt_bias, gate_form, lower_bound))
    else:
        qq, kk, vv, gg, bb = args
        gg = _reference_gate(gg, H, dk, A_log, dt_bias, gate_form, lower_bound)  # XLA fuses it into the gather
        o, s = tpu.chunk(qq, kk, vv, gg, bb, cu, initial_state, scale, interpret=interpret)
    if cu_seqlens is None:
        o = o.reshape(B, T, H, dv)
    return o, s


def recurrent(q, k, v, g, beta, state, scale=None, slot_ids=None, backend: str = "auto", *,
              A_log=None, dt_bias=None, gate_form: Optional[str] = None, lower_bound: float = -5.0,
              platform: Optional[str] = None):
    """Recurrent decode of T (usually 1) tokens for B sequences.

    `slot_ids` `[B]` int: sequence b reads and writes `state[slot_ids[b]]` of a pool `[S, H, dk, dv]` float32 (ids must
    be distinct); without slot ids `state` is `[B, H, dk, dv]`. Returns (o `[B, T, H, dv]`, updated state/pool). The
    kernels alias the pool to the output: call under `jax.jit(..., donate_argnames="state")` (see
    `recurrent_donated`) for a true in-place update.
    """
    _check(q, k, v, g, beta)
    B, T, H, dk = q.shape
    dv = v.shape[-1]
    if slot_ids is None:
        if state.shape[0] != B:
            raise ValueError(f"state must be [B={B}, H, dk, dv] without slot_ids; got {state.shape}")
        slot_ids = jnp.arange(B, dtype=jnp.int32)
    if state.shape[1:] != (H, dk, dv):
        raise ValueError(f"state must be [S, {H}, {dk}, {dv}]; got {state.shape}")
    be = resolve_backend(backend, platform)
    if (be.startswith("gpu") and not _gpu_shapes_ok(dk, dv)) or B * T == 0:
        be = "reference"  # no tokens: the pool is returned as it is
    if be == "reference":
        gg = _reference_gate(g, H, dk, A_log, dt_bias, gate_form, lower_bound)
        return reference.recurrent_slots(q, k, v, gg, beta, state, slot_ids, scale=scale)
    interpret = be.endswith("_interpret")
    kw = _gate_kwargs(A_log, dt_bias, gate_form, lower_bound)
    if be.startswith("gpu"):
        return gpu_triton.recurrent(q, k, v, g, beta, state, slot_ids, scale, interpret=interpret, **kw)
    return tpu.recurrent(q, k, v, g, beta, state, slot_ids, scale, interpret=interpret, **kw)


# Decode step with the pool donated: the update happens in place on GPU/TPU.
recurrent_donated = jax.jit(recurrent, static_argnames=("scale", "backend", "gate_form", "lower_bound", "platform"),
                            donate_argnames=("state",))


def decode_step(x_in, f, b_logit, gate_logit, conv, A_log, dt_bias, o_norm, pools, slot_ids, *, gate_form: str,
                lower_bound: float = -5.0, o_norm_eps: float = 1e-6, scale=None, backend: str = "auto",
                platform: Optional[str] = None):
    """One decode token per sequence of a KDA layer from its projections to its o_proj input, against the slots
    `slot_ids` of the layer's pools (shapes and result: `reference.decode_step`). On the GPU backend one kernel
    (`gpu_triton.decode_step`: about a dozen XLA kernels fewer per layer); elsewhere the same steps as XLA ops around
    this backend's `recurrent`. The pools are updated in place under donation."""
    be = resolve_backend(backend, platform)
    H = A_log.shape[0]
    dk, dv = x_in[0].shape[1] // H, x_in[2].shape[1] // H
    kw = dict(gate_form=gate_form, lower_bound=lower_bound, o_norm_eps=o_norm_eps, scale=scale)
    args = (x_in, f, b_logit, gate_logit, conv, A_log, dt_bias, o_norm, pools, slot_ids)
    if be.startswith("gpu") and _gpu_shapes_ok(dk, dv) and x_in[0].shape[0] and conv[0].shape[0] >= 2:
        return gpu_triton.decode_step(*args, interpret=be.endswith("_interpret"), **kw)

    def rec(q, k, v, g, beta, pool, slots, scale):
        return recurrent(q, k, v, g, beta, pool, scale, slot_ids=slots, backend=be, platform=platform)

    return reference.decode_step(*args, recurrent_fn=rec, **kw)


__all__ = ["chunk", "decode_step", "recurrent", "recurrent_donated", "reference_varlen", "resolve_backend",
           "BACKENDS"]
