"""The MoE router (docs/model.md §7), defined beside the expert kernels so `ops.routed_experts` needs no model code.

`route` = `router_logits` (the router's matmul) then `select_experts` (the sigmoid, the groups, the top-k and the
weights); `gpu_route.select_experts` is the second as one GPU kernel for decode-sized batches.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..matmul import matmul


def router_logits(x_nd, router_de):
    """`x [N, D] @ router [D, E]` in float32 at full precision -> logits `[N, E]` float32 (a GEMM on a GPU even at
    one token: `pallas_kernels.matmul`)."""
    return matmul(x_nd.astype(jnp.float32), router_de.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)


def select_experts(logits_ne, bias_e, cfg):
    """Sigmoid router on logits `[N, E]`. Returns (weights `[N, k]` float32, expert ids `[N, k]` int32).

    `cfg` is anything with the `MoEConfig` fields num_experts, top_k, num_groups, topk_groups, renormalize,
    routed_scaling_factor and bias_in_weights. Selection uses s + bias (with expert groups: keep the `topk_groups`
    groups with the largest sum of their top-2 biased scores); the weights are the UNBIASED s of the chosen experts,
    renormalised, times the scaling factor. Ties go to the lower expert id (`jax.lax.top_k`).
    """
    s = jax.nn.sigmoid(logits_ne)
    choice = s + bias_e.astype(jnp.float32)
    E, G = cfg.num_experts, cfg.num_groups
    if G > 1:
        grouped = choice.reshape(-1, G, E // G)
        group_score = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [N, G]
        _, best_groups = jax.lax.top_k(group_score, cfg.topk_groups)
        keep_group = jnp.zeros(group_score.shape, bool).at[
            jnp.arange(group_score.shape[0])[:, None], best_groups].set(True)
        choice = jnp.where(jnp.repeat(keep_group, E // G, axis=-1), choice, -jnp.inf)
    _, idx = jax.lax.top_k(choice, cfg.top_k)
    w = jnp.take_along_axis(choice if cfg.bias_in_weights else s, idx, axis=-1)
    if cfg.renormalize:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return w * cfg.routed_scaling_factor, idx.astype(jnp.int32)


def route(x_nd, router_de, bias_e, cfg):
    """Sigmoid router: `select_experts(router_logits(x, router), bias, cfg)` -> (weights `[N, k]` float32, expert
    ids `[N, k]` int32)."""
    return select_experts(router_logits(x_nd, router_de), bias_e, cfg)
