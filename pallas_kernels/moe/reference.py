"""MoE reference ops in plain jnp (docs/model.md §7): dropless expert FFN by sorting token-expert pairs into ragged
groups.

Memory is O(N·k·width): tokens are gathered into expert order and run through `jax.lax.ragged_dot`; no dense
all-experts einsum is ever formed, so 896 experts cost nothing extra.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def grouped_matmul(x_mk, w_ekn, group_sizes_e):
    """Rows of x sorted by group; rows [off_e, off_e + size_e) multiply w[e]. Returns `[M, N]` float32."""
    return jax.lax.ragged_dot(x_mk, w_ekn, group_sizes_e.astype(jnp.int32),
                              preferred_element_type=jnp.float32)


def sort_by_expert(expert_idx_nk, num_experts: int):
    """Stable sort of the N·k (token, slot) pairs by expert. Returns (order [N·k], token_of_row [N·k], sizes [E])."""
    flat = expert_idx_nk.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token_of_row = order // expert_idx_nk.shape[1]
    sizes = jnp.bincount(flat, length=num_experts)
    return order, token_of_row, sizes


def expert_ffn(x_nd, expert_idx_nk, weight_nk, w_gate_edf, w_up_edf, w_down_efd, activation):
    """Σ_k weight[n,k] · down_e(act(gate_e x, up_e x)) for e = expert_idx[n,k]. Returns `[N, D]` float32.

    `activation(g, u)` gets float32 gate and up projections. Deterministic: fixed sort and a segment sum.
    """
    N = x_nd.shape[0]
    E = w_gate_edf.shape[0]
    order, token_of_row, sizes = sort_by_expert(expert_idx_nk, E)
    x_sorted = x_nd[token_of_row]
    h = activation(grouped_matmul(x_sorted, w_gate_edf, sizes), grouped_matmul(x_sorted, w_up_edf, sizes))
    y = grouped_matmul(h.astype(w_down_efd.dtype), w_down_efd, sizes)
    y = y * weight_nk.reshape(-1)[order][:, None].astype(jnp.float32)
    return jax.ops.segment_sum(y, token_of_row, num_segments=N)
