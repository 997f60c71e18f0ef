"""The MXFP4 expert FFN in one tile layout (Mosaic GPU): `expert_ffn_tiled`.

x is gathered into padded tile rows once (`rows.tile_plan` or `rows.slot_tile_plan`), gate and up (fused into one
kernel with the activation where `MgpuConfig.gate_up="fused"`) write h in that layout, down reads it as it is, and
one gather brings the rows back: `down(act(gate x, up x))` -> `[M, D]` fp32, rows past Σ group_sizes zero.
`tiled_matmul` / `tiled_gated_matmul` are its matmuls on the tile layout.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .config import MgpuConfig, fit_config, tiled_config
from .kernels import kernel_call, kernel_call_gated_ws
from .layout import PreparedWeight, _planes_in_contraction_order, columns_as_planes, expert_scale
from .rows import TilePlan, gather_x, tile_plan


def _tile_layout_operands(x_pad, w: PreparedWeight, config: MgpuConfig):
    """x planes of padded rows and the kernel's config for weight `w` (the padded plan, step width fitted).
    `x_pad`: `[m_pad, K]` rows, or already the planes `[2, m_pad, K/2]` (what a fused gate / up kernel with
    out_order="planes" writes), taken as they are."""
    cfg = fit_config(dataclasses.replace(config, plan="xla"), w.in_features)
    if x_pad.ndim == 3:
        return x_pad.astype(jnp.bfloat16), cfg
    return _planes_in_contraction_order(x_pad.astype(jnp.bfloat16)), cfg


def tiled_matmul(x_pad, plan: TilePlan, w: PreparedWeight, config: MgpuConfig, out_dtype=jnp.float32):
    """One grouped matmul in the tile layout: `x_pad [m_pad, K]` (rows as `plan` pads them; or their planes
    `[2, m_pad, K/2]`) -> `[m_pad, N]` (columns in `w`'s output order), each live tile's rows times its expert's
    weight (placed layout: times `out_scale`, in fp32), accumulated in fp32 and written by the kernel in
    `out_dtype` (fp32 or bf16). Rows of dead tiles are left unwritten (never read back). The x plane transpose
    here is elementwise XLA work that fuses into whatever produced x_pad (the dispatch gather, the activation).
    The placed layout's expert factor is applied by the kernel to its fp32 accumulators."""
    xs, cfg = _tile_layout_operands(x_pad, w, config)
    return kernel_call(xs, plan.tile_group, plan.num_tiles, w, cfg, out_dtype, scale=expert_scale(w))


def tiled_gated_matmul(x_pad, plan: TilePlan, w_gate: PreparedWeight, w_up: PreparedWeight, activation,
                       config: MgpuConfig, out_dtype=jnp.float32):
    """Gate, up and the activation in the tile layout, one kernel (`kernel_call_gated_ws`): `x_pad [m_pad, K]` ->
    h `[m_pad, F]` in `out_dtype` (fp32 or bf16; rows of dead tiles unwritten) — for weights with
    out_order="planes", h as the down matmul's x planes `[2, m_pad, F/2]`."""
    xs, cfg = _tile_layout_operands(x_pad, w_gate, config)
    return kernel_call_gated_ws(xs, plan.tile_group, plan.num_tiles, w_gate, w_up, activation, cfg,
                                expert_scale(w_gate), expert_scale(w_up), out_dtype)


def expert_ffn_tiled(x_rows, group_sizes, w_gate: PreparedWeight, w_up: PreparedWeight, w_down: PreparedWeight,
                     activation, *, h_dtype=jnp.bfloat16, config: MgpuConfig | None = None, matmul=None,
                     gated_matmul=None, gate_up_dtype=jnp.float32, token_of_row=None,
                     out_rows=None, plan: TilePlan | None = None):
    """The expert FFN on rows sorted by expert, `down(act(gate x, up x))` -> `[M, D]` fp32, with all three matmuls
    in one tile layout: x is gathered into padded rows once (`tile_plan`), gate and up write `[m_pad, F]`, the
    activation runs on those rows, down reads them as they are, and one gather brings the rows back — instead of a
    pad gather and an unpad gather around each of the three matmuls (`grouped_matmul`). Rows past Σ group_sizes
    are zeros. Padded rows carry zeros (or, in dead tiles, whatever memory held); each output row depends only on
    its own input row, so none of that reaches a real row.

    `token_of_row [M]`: x_rows is then the `[N, K]` tokens the sorted rows come from (sorted row i =
    x_rows[token_of_row[i]]), and x's planes are made on them before the gather (`gather_x`); an int k: row i is
    token i // k (routed pairs in (token, slot) order).
    `out_rows [R]` int32: the result is those sorted rows, in that order (`y[out_rows]` `[R, D]`), gathered from the
    padded rows in one step (`ops.expert_ffn` asks for (token, slot) order, so its combine gathers nothing).

    `config`: the kernel's tile shape and the FFN's plumbing (default `tiled_config(M / E, (F, D))`;
    `gate_up="fused"` runs gate, up and the activation as one kernel); `matmul` / `gated_matmul`: the tile-layout
    matmul and fused gate / up (default `tiled_matmul` / `tiled_gated_matmul`, the Mosaic GPU kernels; tests pass
    reference ones to check the plumbing on CPU).
    `plan`: a tile plan made elsewhere (`slot_tile_plan`: the rows are routed pairs in (token, slot) order, each
    row's token in `token_of_row`); `group_sizes` is then unused and `config.rows` must be the plan's tile rows.
    `gate_up_dtype`: what the separate gate and up kernels write for the activation to read (fp32 accumulation
    either way; bf16 rounds each product before the activation, no faster as measured)."""
    if token_of_row is None:
        M = x_rows.shape[0]
    else:
        M = x_rows.shape[0] * token_of_row if isinstance(token_of_row, int) else token_of_row.shape[0]
    E = w_gate.num_experts
    if w_up.out_order != w_gate.out_order or w_down.out_order != "natural":
        raise ValueError("expert_ffn_tiled: gate and up need one output order and down the natural one "
                         f"(`prepare_ffn_weights`), got {w_gate.out_order}, {w_up.out_order}, {w_down.out_order}")
    cfg = config or tiled_config(M / E, (w_gate.out_features, w_down.out_features))
    matmul = matmul or tiled_matmul
    gated_matmul = gated_matmul or tiled_gated_matmul
    given_plan = plan is not None
    if not given_plan:
        plan = tile_plan(group_sizes, M, E, cfg.rows)
    elif plan.tile_group.shape[0] * cfg.rows != plan.src.shape[0] or plan.pad_row.shape[0] != M:
        raise ValueError(f"expert_ffn_tiled: a plan of {plan.tile_group.shape[0]} tiles, {plan.src.shape[0]} padded "
                         f"rows for {plan.pad_row.shape[0]} rows does not fit {cfg.rows}-row tiles over {M} rows")
    x_in = gather_x(x_rows, plan.src, token_of_row)
    if cfg.gate_up == "fused":
        # the kernel rounds h to h_dtype itself (as XLA's convert would: to nearest even), so h is written and
        # read back at half the bytes of fp32; with out_order="planes" it writes down's x planes
        written = h_dtype if jnp.dtype(h_dtype) in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)) else jnp.float32
        h = gated_matmul(x_in, plan, w_gate, w_up, activation, cfg, out_dtype=written).astype(h_dtype)
    else:
        gate, up = (matmul(x_in, plan, w, cfg, gate_up_dtype).astype(jnp.float32) for w in (w_gate, w_up))
        h = activation(gate, up).astype(h_dtype)
        if w_gate.out_order == "planes":  # columns in plane order: the planes are whole 64-column blocks of h
            h = columns_as_planes(h)
    y_pad = matmul(h, plan, w_down, cfg.down_config or cfg)
    pad_row, live = plan.pad_row, plan.live
    if given_plan and out_rows is None:
        # materialised for the reason given below: the gather back (fused into the combine) reads each row's index
        # directly instead of recomputing it from the expert ranks inside its reduction
        pad_row = jax.lax.optimization_barrier(pad_row)
    if out_rows is not None:  # the rows asked for, straight from their padded rows
        # composed and materialised here (the barrier): left to XLA, the index chain out_rows -> pad_row / live
        # fuses into the consumer (the combine's reduction), which then waits on three dependent loads per row
        pad_row, live = jax.lax.optimization_barrier((pad_row[out_rows], live[out_rows]))
    return jnp.where(live[:, None], y_pad[pad_row], 0.0)
