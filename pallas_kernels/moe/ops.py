"""Public MoE ops: grouped matmul and the dropless expert FFN, with the backend chosen in one place.

    grouped_matmul(x [M, K], w, group_sizes [E], *, w_scale=None, backend="auto", out_dtype=float32)
    expert_ffn(x [N, D], expert_idx [N, k], weight [N, k], w_gate, w_up, w_down, activation, *, backend="auto")
    routed_experts(x, router [D, E], bias [E], cfg, w_gate, w_up, w_down, activation, *, backend="auto")

Weights are dense `[E, K, N]` (K = input width, N = output width) or MXFP4: `MXFP4Weight(packed [E, N, K/2],
scale [E, N, K/32])`, a `(packed, scale)` pair, or `w=packed, w_scale=scale` — the checkpoint's torch `[out, in]`
orientation, decoded inside the kernels tile by tile. A weight prepared once for the Mosaic GPU MXFP4 kernel
(`mgpu_mxfp4.prepare_weight`: placed codes, transposed scales; 0.64-0.67 of copy bandwidth at 8 rows per expert on an
H200 as one grouped matmul, the Triton kernel 0.46) runs that kernel on the "gpu" backend where its shape allows, and
is turned back into an `MXFP4Weight` (`mgpu_mxfp4.unprepare_weight`, exact) for every other backend or shape. With all
three FFN weights prepared, `expert_ffn_sorted` runs the FFN in one tile layout (`mgpu_mxfp4.expert_ffn_tiled`: 0.68-0.72
of copy for the whole FFN at 8 rows per expert; a model on a GPU prepares its MXFP4 experts at load).

Backends: "reference" (jax.lax.ragged_dot, fp32 accumulation; MXFP4 is dequantised whole — a definition, not a
fast path), "gpu" (the native Triton kernel through jax-triton, `gpu_triton.py`; "triton" is another name of it),
"mgpu" (JAX's bundled Mosaic GPU ragged_dot, bf16 only, `mgpu_ragged.py`), "tpu" (Pallas Mosaic TPU, `tpu.py`).
"auto" picks by the platform through `GPU_CHOICE` (where jax-triton can launch; else the reference) / TPU / else
reference; the platform is the ops' `platform=` argument ("cpu" | "tpu" | "gpu" / "cuda"), None meaning
`jax.default_backend()` at trace time (pass it when exporting for another platform). `interpret=True` runs the
kernels through their interpreters (GPU: Triton's interpreter, under TRITON_INTERPRET=1; TPU:
`pltpu.InterpretParams()`), which is how CPU tests check them.

Determinism: routing is a stable sort of (token, slot) pairs by expert; the combine gathers each token's k expert
outputs back into (token, slot) order and sums the k slots in order — no scatter-add, so no atomics on any
backend: the same input gives the same bits.
"""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp

# the package's own modules by their full name: `from . import x` would make this module import the package, whose
# __init__ imports this module (tests/test_import_layers.py counts that as a cycle)
import pallas_kernels.moe.gpu_route as _gpu_route
import pallas_kernels.moe.gpu_triton as _gpu_triton
import pallas_kernels.moe.mgpu_mxfp4 as _mgpu_mx
import pallas_kernels.moe.mgpu_ragged as _mgpu_ragged
import pallas_kernels.moe.mxfp4 as mx
import pallas_kernels.moe.reference as reference
import pallas_kernels.moe.schedule as _schedule
import pallas_kernels.moe.tpu as _tpu

from ..platform import resolve_platform
from .activations import ACTIVATIONS
from .routing import route

BACKENDS = ("reference", "gpu", "mgpu", "tpu", "triton")
_ALIASES = {"triton": "gpu"}

# The GPU kernel used by backend="auto", per weight kind; chosen by measurement (bench/moe.py, docs/performance.md):
# at K3 shapes on an H200 the Triton kernel ran 389 TFLOP/s, JAX's ragged_dot_mgpu 270 (best of 4 configs).
GPU_CHOICE = {"bf16": "gpu", "mxfp4": "gpu"}

# Whether expert_ffn runs gate and up as one kernel with the activation in its epilogue, per backend. GPU: measured
# 2.20 ms fused vs 2.02 ms for two 128x256-tile matmuls + XLA activation (H200, K3 shapes) -> off (the Triton kernel
# runs two weights as two launches anyway). TPU: unmeasured; on paper the fused kernel saves writing and re-reading
# two fp32 [rows, F] tensors and keeps one x DMA per step.
FUSE_GATE_UP = {"gpu": False, "tpu": True, "mgpu": False, "reference": False}


def resolve_backend(backend: str = "auto", *, quantized: bool = False, platform: Optional[str] = None) -> str:
    """The one place the MoE ops pick an implementation; "auto" by `platform` (None: the default backend's): on a
    GPU `GPU_CHOICE` where jax-triton can launch (else the reference, e.g. exporting for CUDA from a CPU host).
    Other names are resolved ("triton" -> "gpu")."""
    if backend == "auto":
        target = resolve_platform(platform)
        if target == "tpu":
            return "tpu"
        if target == "gpu" and _gpu_triton.available():
            return GPU_CHOICE["mxfp4" if quantized else "bf16"]
        return "reference"
    if backend not in BACKENDS:
        raise ValueError(f"unknown MoE backend {backend!r}; choose one of {', '.join(BACKENDS)} or 'auto'")
    backend = _ALIASES.get(backend, backend)
    if backend == "mgpu" and quantized:
        return "gpu"  # the bundled Mosaic GPU kernel has no MXFP4 path
    return backend


def _as_weight(w, w_scale=None):
    if isinstance(w, _mgpu_mx.PreparedWeight):
        return w
    q = mx.as_mxfp4(w, w_scale)
    return q if q is not None else w


def _quantized(w) -> bool:
    return isinstance(w, (mx.MXFP4Weight, _mgpu_mx.PreparedWeight))


def _check(x, w, group_sizes):
    M, K = x.shape
    if _quantized(w):
        E, Kw = w.num_experts, w.in_features
    else:
        if w.ndim != 3:
            raise ValueError(f"expert weights must be [E, K, N], got shape {list(w.shape)}")
        E, Kw = w.shape[0], w.shape[1]
    if Kw != K:
        raise ValueError(f"x has K={K} columns but the expert weights take K={Kw}")
    if group_sizes.shape != (E,):
        raise ValueError(f"group_sizes must be [E] = [{E}], got {list(group_sizes.shape)}")


def _reference_gmm(x, weights, group_sizes, activation, out_dtype):
    ws = [mx.dequantize(w, x.dtype) if isinstance(w, mx.MXFP4Weight) else w for w in weights]
    outs = [reference.grouped_matmul(x, w, group_sizes) for w in ws]
    out = activation(*outs) if len(outs) == 2 else outs[0]
    return out.astype(out_dtype)


def _gmm(x, weights, group_sizes, *, backend, activation=None, out_dtype=jnp.float32, interpret=False,
         config=None, fill_uncovered=True, platform=None):
    quantized = _quantized(weights[0])
    b = resolve_backend(backend, quantized=quantized, platform=platform)
    if any(isinstance(w, _mgpu_mx.PreparedWeight) for w in weights):
        mcfg = config if isinstance(config, _mgpu_mx.MgpuConfig) else None
        if (b == "gpu" and not interpret and resolve_platform(platform) == "gpu"
                and all(_mosaic_takes(x.shape[0], w, mcfg) for w in weights)):
            # the Mosaic GPU MXFP4 kernel, one matmul per weight, activation in XLA (always zero-fills uncovered rows)
            outs = [_mgpu_mx.grouped_matmul(x, w, group_sizes, config=mcfg) for w in weights]
            return (activation(*outs) if len(outs) == 2 else outs[0]).astype(out_dtype)
        weights = tuple(_mgpu_mx.unprepare_weight(w) if isinstance(w, _mgpu_mx.PreparedWeight) else w
                        for w in weights)
        config = None if mcfg is not None else config
    if b == "reference":
        return _reference_gmm(x, weights, group_sizes, activation, out_dtype)
    if b == "gpu":
        return _gpu_triton.grouped_matmul(x, weights, group_sizes, activation=activation, out_dtype=out_dtype,
                                          config=config, interpret=interpret, fill_uncovered=fill_uncovered)
    if b == "tpu":
        return _tpu.grouped_matmul(x, weights, group_sizes, activation=activation, out_dtype=out_dtype,
                                   config=config, interpret=interpret)
    # mgpu: one matmul per weight, activation in XLA
    outs = [_mgpu_ragged.mgpu_grouped_matmul(x, w, group_sizes, out_dtype=jnp.float32, config=config)
            for w in weights]
    return (activation(*outs) if len(outs) == 2 else outs[0]).astype(out_dtype)


def _mosaic_takes(num_rows: int, w, config) -> bool:
    """Whether the Mosaic GPU MXFP4 kernel runs this prepared weight (its layout's decode, its shape constraints)."""
    if not isinstance(w, _mgpu_mx.PreparedWeight):
        return False
    cfg = config or _mgpu_mx.config_for(num_rows, w)
    return _mgpu_mx.supports(w.in_features, w.out_features, cfg) and (cfg.mma == "bf16" or w.layout == "natural")


def _tiled_ffn_takes(num_rows: int, weights, backend, interpret, config, platform=None) -> bool:
    """Whether `expert_ffn_sorted` runs `mgpu_mxfp4.expert_ffn_tiled`: on a GPU, not interpreted, all three weights
    prepared, and each weight's shape and layout taken by the kernel at the tile-layout config."""
    if backend != "gpu" or interpret or resolve_platform(platform) != "gpu":
        return False
    if not all(isinstance(w, _mgpu_mx.PreparedWeight) for w in weights):
        return False
    cfg = config if isinstance(config, _mgpu_mx.MgpuConfig) else _mgpu_mx.tiled_config(
        num_rows / weights[0].num_experts, (weights[0].out_features, weights[2].out_features))
    down_cfg = cfg.down_config or cfg  # down may run on a config of its own (`MgpuConfig.down_config`)
    return all(_mosaic_takes(num_rows, w, _mgpu_mx.fit_config(c, w.in_features))
               for w, c in zip(weights, (cfg, cfg, down_cfg)))


def grouped_matmul(x, w, group_sizes, *, w_scale=None, backend: str = "auto", out_dtype=jnp.float32,
                   interpret: bool = False, config=None, platform: Optional[str] = None):
    """Rows of `x [M, K]` sorted by group; rows [off_e, off_e + size_e) multiply expert e. Returns `[M, N]`.

    `w`: dense `[E, K, N]`, or MXFP4 (`MXFP4Weight`, `(packed, scale)`, or `w=packed` uint8 `[E, N, K/2]` with
    `w_scale` uint8 E8M0 `[E, N, K/32]`, or a `mgpu_mxfp4.PreparedWeight`). Rows past Σ group_sizes are zeros (as
    `jax.lax.ragged_dot`).
    `config`: block shapes for the chosen kernel (`gpu_triton.GpuConfig`, `mgpu_ragged.MgpuConfig`,
    `mgpu_mxfp4.MgpuConfig`, `tpu.TpuConfig`).
    """
    w = _as_weight(w, w_scale)
    _check(x, w, group_sizes)
    return _gmm(x, (w,), group_sizes, backend=backend, out_dtype=out_dtype, interpret=interpret, config=config,
                platform=platform)


def gated_grouped_matmul(x, w_gate, w_up, group_sizes, activation, *, backend: str = "auto",
                         out_dtype=jnp.bfloat16, interpret: bool = False, config=None,
                         platform: Optional[str] = None):
    """`activation(x @ Wg[e], x @ Wu[e])` per row, with the activation fused after the two fp32 accumulators
    (one kernel, h stored once) on the TPU backend; on the others two matmuls and the activation in XLA."""
    w_gate, w_up = _as_weight(w_gate), _as_weight(w_up)
    _check(x, w_gate, group_sizes)
    _check(x, w_up, group_sizes)
    return _gmm(x, (w_gate, w_up), group_sizes, backend=backend, activation=resolve_activation(activation),
                out_dtype=out_dtype, interpret=interpret, config=config, platform=platform)


def resolve_activation(activation):
    """A callable `act(g, u)` on fp32, or one of the names "situ", "swiglu", "clamped_swiglu" (docs/model.md §7)."""
    if callable(activation):
        return activation
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; choose one of {', '.join(ACTIVATIONS)} or pass a "
                         "callable")
    return ACTIVATIONS[activation]


COUNTING_SORT_MAX_PAIRS = _schedule.COUNTING_SORT_MAX_PAIRS


def dispatch_plan(expert_idx_nk, num_experts: int):
    """Dropless dispatch plan `expert_idx_nk [N, k]` int (each in [0, num_experts)) -> (order [N·k], token_of_row
    [N·k], group_sizes [E], slot_row [N·k]) int32: the (token, slot) pairs stably sorted by expert, as
    `reference.sort_by_expert`, and each pair's sorted row (`slot_rows(order)`, the combine's gather index).

    Decode-sized batches (≤ `COUNTING_SORT_MAX_PAIRS` pairs) are ranked by counting (`schedule.expert_ranks`): a
    pair's sorted row is its expert's first row plus the number of earlier pairs with the same expert; larger ones
    take the reference sort."""
    flat = expert_idx_nk.reshape(-1).astype(jnp.int32)
    pairs = flat.shape[0]
    if pairs > COUNTING_SORT_MAX_PAIRS:
        order, token_of_row, sizes = reference.sort_by_expert(expert_idx_nk, num_experts)
        return order, token_of_row, sizes, slot_rows(order)
    rank, sizes = _schedule.expert_ranks(flat, num_experts)
    slot_row = (jnp.cumsum(sizes) - sizes)[flat] + rank
    order = jnp.zeros_like(flat).at[slot_row].set(jnp.arange(pairs, dtype=jnp.int32), unique_indices=True)
    return order, order // expert_idx_nk.shape[1], sizes, slot_row


def sort_tokens(expert_idx_nk, num_experts: int):
    """`dispatch_plan` without the slot rows: (order [N·k], token_of_row [N·k], group_sizes [E]) int32."""
    return dispatch_plan(expert_idx_nk, num_experts)[:3]


def slot_rows(order):
    """The sorted row of each (token, slot) pair `[N·k]` int32: the inverse of `sort_tokens`' `order`."""
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype), unique_indices=True)


def combine_slots(y_slots, weight_nk):
    """Expert outputs in (token, slot) order `[N·k, D]` -> `Σ_k weight[n, k] · y` `[N, D]` float32 (deterministic:
    a fixed-order sum over each token's k rows)."""
    N, k = weight_nk.shape
    y = y_slots.astype(jnp.float32).reshape(N, k, y_slots.shape[-1])  # (-1 is ambiguous when N = 0)
    return jnp.sum(y * weight_nk.astype(jnp.float32)[:, :, None], axis=1)


def combine(y_rows, order, weight_nk):
    """Sorted expert outputs `[N·k, D]` -> `Σ_k weight[n, k] · y` `[N, D]` float32, in slot order (deterministic).

    Rows may be masked beforehand (e.g. zeroed where a pair's expert lives elsewhere)."""
    return combine_slots(y_rows[slot_rows(order)], weight_nk)


def expert_ffn_sorted(x_rows, group_sizes, w_gate, w_up, w_down, activation, *, backend: str = "auto",
                      interpret: bool = False, fuse: bool | None = None, h_dtype=None, fill_uncovered: bool = True,
                      configs=None, token_of_row=None, out_rows=None, platform: Optional[str] = None):
    """The expert FFN on rows already sorted by expert: `down(act(gate x, up x))` `[rows, D]` float32.

    `fuse=True` runs gate and up in one kernel with the activation in its epilogue (TPU); None takes
    `FUSE_GATE_UP[backend]`. `h_dtype`:
    the dtype h is stored in (default: the down weight's dtype, bf16 for MXFP4 — as the reference casts).
    `configs`: optional (gate/up config, down config). `token_of_row [rows]`: x_rows is then the `[N, D]` tokens
    the sorted rows come from (row i = x_rows[token_of_row[i]]; the tile-layout path gathers from them itself).
    `out_rows [R]` int32: return those sorted rows, in that order (`y[out_rows]`, e.g. `slot_rows(order)` for
    `combine_slots`); the tile-layout path gathers them from its padded rows in one step instead of two."""
    act = resolve_activation(activation)
    w_gate, w_up, w_down = _as_weight(w_gate), _as_weight(w_up), _as_weight(w_down)
    if h_dtype is None:
        h_dtype = x_rows.dtype if _quantized(w_down) else w_down.dtype
    c_up, c_down = configs or (None, None)
    b = resolve_backend(backend, quantized=_quantized(w_gate), platform=platform)
    num_rows = x_rows.shape[0] if token_of_row is None else token_of_row.shape[0]
    if _tiled_ffn_takes(num_rows, (w_gate, w_up, w_down), b, interpret, c_up, platform):
        # all three weights prepared for the Mosaic MXFP4 kernel: one tile layout for the whole FFN (x padded once,
        # h kept padded, one gather back) instead of padding around each matmul
        return _mgpu_mx.expert_ffn_tiled(x_rows, group_sizes, w_gate, w_up, w_down, act, h_dtype=h_dtype,
                                         config=c_up, token_of_row=token_of_row, out_rows=out_rows)
    if token_of_row is not None:
        x_rows = x_rows[token_of_row]
    if fuse is None:
        fuse = FUSE_GATE_UP[b]
    if fuse and b in ("gpu", "tpu") and not isinstance(w_gate, _mgpu_mx.PreparedWeight):
        h = _gmm(x_rows, (w_gate, w_up), group_sizes, backend=b, activation=act, out_dtype=h_dtype,
                 interpret=interpret, config=c_up, fill_uncovered=fill_uncovered, platform=platform)
    else:
        g = _gmm(x_rows, (w_gate,), group_sizes, backend=b, interpret=interpret, config=c_up,
                 fill_uncovered=fill_uncovered, platform=platform)
        u = _gmm(x_rows, (w_up,), group_sizes, backend=b, interpret=interpret, config=c_up,
                 fill_uncovered=fill_uncovered, platform=platform)
        h = act(g, u).astype(h_dtype)
    y = _gmm(h, (w_down,), group_sizes, backend=b, interpret=interpret, config=c_down,
             fill_uncovered=fill_uncovered, platform=platform)
    return y if out_rows is None else y[out_rows]


def expert_ffn(x_nd, expert_idx_nk, weight_nk, w_gate, w_up, w_down, activation, *, backend: str = "auto",
               interpret: bool = False, fuse: bool | None = None, configs=None, platform: Optional[str] = None):
    """Σ_k weight[n,k] · down_e(act(gate_e x, up_e x)) for e = expert_idx[n,k]; `[N, D]` float32.

    Drop-in for `reference.expert_ffn` (same arguments and result) with a backend choice. Dropless: every
    (token, slot) pair is computed, whatever the load per expert. Deterministic on every backend."""
    w_gate, w_up, w_down = _as_weight(w_gate), _as_weight(w_up), _as_weight(w_down)
    E = w_gate.num_experts if _quantized(w_gate) else w_gate.shape[0]
    N, k = expert_idx_nk.shape
    c_up = (configs or (None, None))[0]
    b = resolve_backend(backend, quantized=_quantized(w_gate), platform=platform)
    if _tiled_ffn_takes(N * k, (w_gate, w_up, w_down), b, interpret, c_up, platform):
        # the tile-layout FFN planned from the routing itself: the padded rows hold the (token, slot) pairs, and the
        # rows come back in (token, slot) order, with no sorted rows in between (`mgpu_mxfp4.slot_tile_plan`)
        cfg = c_up if isinstance(c_up, _mgpu_mx.MgpuConfig) else _mgpu_mx.tiled_config(
            N * k / E, (w_gate.out_features, w_down.out_features))
        if N * k:
            # decode-sized batches plan in one Triton kernel (`gpu_route`, where jax-triton launches: the Mosaic
            # FFN does not need it), larger ones in XLA: the same plan
            plan = (_gpu_route.slot_tile_plan(expert_idx_nk, E, cfg.rows)
                    if _gpu_route.takes(N, E) and _gpu_route.available()
                    else _mgpu_mx.slot_tile_plan(expert_idx_nk, E, cfg.rows))
            y = _mgpu_mx.expert_ffn_tiled(x_nd, None, w_gate, w_up, w_down, resolve_activation(activation),
                                          h_dtype=x_nd.dtype, config=cfg, plan=plan,
                                          token_of_row=k)
            return combine_slots(y, weight_nk)
    _, token_of_row, sizes, slot_row = dispatch_plan(expert_idx_nk, E)
    # the FFN hands its rows back in (token, slot) order: on the tile-layout path one gather from the padded rows
    # instead of a gather back to sorted rows and another into slot order
    y = expert_ffn_sorted(x_nd, sizes, w_gate, w_up, w_down, activation, backend=backend, interpret=interpret,
                          fuse=fuse, configs=configs, token_of_row=token_of_row, out_rows=slot_row, platform=platform)
    return combine_slots(y, weight_nk)


def routed_experts(x_nd, router_de, bias_e, cfg, w_gate, w_up, w_down, activation, *, backend: str = "auto",
                   interpret: bool = False, platform: Optional[str] = None):
    """Route (`routing.route`, docs/model.md §7; `cfg` has the `MoEConfig` router fields) then `expert_ffn`.
    Returns `[N, D]` float32."""
    weight, idx = route(x_nd, router_de, bias_e, cfg)
    return expert_ffn(x_nd, idx, weight, w_gate, w_up, w_down, activation, backend=backend, interpret=interpret,
                      platform=platform)
