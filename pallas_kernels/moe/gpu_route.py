"""The MoE's decode-sized glue on a GPU as two native Triton kernels (launched through jax-triton; CPU tests:
Triton's interpreter): expert selection from the router logits, and the tile plan of the routed pairs.

At a few tokens per step the routing and the tile plan are a few hundred bytes of work, but as XLA ops they are
about fifteen small kernels per MoE layer (sigmoid, the group and expert top-k, the gathers of the weights, the
bincount, the ranks, the cumulative sums, the tile search, the scatter of the source rows), each a launch the step
pays for. Each kernel here is one program that holds the whole batch in registers:

* `select_experts(logits [N, E], bias [E], cfg)` -> (weights `[N, k]` float32, expert ids `[N, k]` int32):
  `routing.select_experts` (the reference), the same selection (ties to the lower expert id, as `jax.lax.top_k`)
  and the same weights up to the order of the k-term sum that renormalises them.
* `slot_tile_plan(expert_idx [N, k], E, rows)` -> `mgpu_mxfp4.TilePlan`: `rows.slot_tile_plan` (the reference),
  equal to it element for element.

`takes(N, E)` says whether a batch fits one program (`MAX_ELEMENTS`); larger batches (prefill chunks) take the XLA
forms, where the work is large enough for XLA's kernels. Plain `tl` operations only: the kernels compile for ROCm too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import pallas_kernels.moe.schedule as schedule  # not `from . import`: see moe/ops.py
from pallas_kernels.moe.mgpu_mxfp4.rows import TilePlan

from ..triton_call import available as _launcher_available
from ..triton_call import call, jit, tl

__all__ = ["MAX_ELEMENTS", "available", "select_experts", "slot_tile_plan", "takes"]

# Tokens x experts (powers of two) one program holds: 32 tokens of 1,024 experts. A [N, E] int32 tensor spread
# over 8 warps is 128 registers a thread at this size; beyond it the batch is a prefill chunk and XLA's forms run.
MAX_ELEMENTS = 32 * 1024
_WARPS = 8


def available() -> bool:
    """Whether the kernels can launch on a GPU here (triton and jax-triton)."""
    return _launcher_available()


def _pow2(n: int) -> int:
    return max(1, 1 << (int(n) - 1).bit_length())


def takes(tokens: int, num_experts: int) -> bool:
    """Whether `tokens` rows of `num_experts` router logits fit one program of these kernels."""
    return 0 < tokens and _pow2(tokens) * _pow2(num_experts) <= MAX_ELEMENTS


@jit
def _select_kernel(logit_ptr, bias_ptr, w_ptr, idx_ptr, N: tl.constexpr, E: tl.constexpr, TOP_K: tl.constexpr,
                   GROUPS: tl.constexpr, TOPK_GROUPS: tl.constexpr, BIAS_IN_WEIGHTS: tl.constexpr,
                   RENORMALIZE: tl.constexpr, SCALE: tl.constexpr, BN: tl.constexpr, BE: tl.constexpr,
                   BK: tl.constexpr, BG: tl.constexpr):
    n = tl.arange(0, BN)
    e = tl.arange(0, BE)
    kk = tl.arange(0, BK)
    row_ok = n < N
    ok = row_ok[:, None] & (e[None, :] < E)
    logit = tl.load(logit_ptr + n[:, None] * E + e[None, :], mask=ok, other=0.0)
    s = tl.sigmoid(logit)
    choice = tl.where(ok, s + tl.load(bias_ptr + e, mask=e < E, other=0.0)[None, :], float("-inf"))
    if GROUPS > 1:
        # a group's score: the sum of its two largest biased scores; keep the TOPK_GROUPS best groups
        group = e // (E // GROUPS)
        g = tl.arange(0, BG)
        score = tl.full((BN, BG), float("-inf"), tl.float32)
        for gi in tl.static_range(GROUPS):
            c = tl.where(ok & (group == gi)[None, :], choice, float("-inf"))
            first = tl.max(c, axis=1)
            at = tl.min(tl.where(c == first[:, None], e[None, :], BE), axis=1)
            second = tl.max(tl.where(e[None, :] == at[:, None], float("-inf"), c), axis=1)
            score = tl.where(g[None, :] == gi, (first + second)[:, None], score)
        keep = tl.zeros((BN, BE), tl.int32)
        for _ in tl.static_range(TOPK_GROUPS):
            best = tl.max(score, axis=1)
            at = tl.min(tl.where(score == best[:, None], g[None, :], BG), axis=1)
            keep = tl.where(group[None, :] == at[:, None], 1, keep)
            score = tl.where(g[None, :] == at[:, None], float("-inf"), score)
        choice = tl.where(keep != 0, choice, float("-inf"))
    if BIAS_IN_WEIGHTS:
        weight_of = choice
    else:
        weight_of = s
    # top-k one expert at a time: the largest remaining choice, ties to the lowest id (as jax.lax.top_k); taken
    # experts are excluded by a mask, not by their value, so -inf choices are taken in id order as top_k does
    taken = tl.zeros((BN, BE), tl.int32)
    idx = tl.zeros((BN, BK), tl.int32)
    w = tl.zeros((BN, BK), tl.float32)
    for j in tl.static_range(TOP_K):
        left = tl.where(taken == 0, choice, float("-inf"))
        best = tl.max(left, axis=1)
        at = tl.min(tl.where(ok & (taken == 0) & (left == best[:, None]), e[None, :], BE), axis=1)
        hit = e[None, :] == at[:, None]
        w_j = tl.sum(tl.where(hit, weight_of, 0.0), axis=1)
        taken = tl.where(hit, 1, taken)
        idx = tl.where(kk[None, :] == j, at[:, None], idx)
        w = tl.where(kk[None, :] == j, w_j[:, None], w)
    if RENORMALIZE:
        w = w / (tl.sum(w, axis=1)[:, None] + 1e-20)
    w = w * SCALE
    pair_ok = row_ok[:, None] & (kk[None, :] < TOP_K)
    out = n[:, None] * TOP_K + kk[None, :]
    tl.store(w_ptr + out, w, mask=pair_ok)
    tl.store(idx_ptr + out, idx, mask=pair_ok)


def select_experts(logits_ne, bias_e, cfg, *, interpret: bool = False):
    """Expert choice from router logits `[N, E]` (float32) and the selection bias `[E]` -> (weights `[N, k]`
    float32, expert ids `[N, k]` int32), as `routing.select_experts`; `cfg` has the `MoEConfig` router fields.
    One program: `takes(N, E)` must hold. `interpret`: Triton's interpreter on the host."""
    N, E = logits_ne.shape
    k, G = cfg.top_k, cfg.num_groups
    if not takes(N, E):
        raise ValueError(f"select_experts: {N} tokens x {E} experts exceed one program ({MAX_ELEMENTS} elements)")
    w, idx = call(logits_ne.astype(jnp.float32), bias_e.astype(jnp.float32), kernel=_select_kernel,
                  out_shape=[jax.ShapeDtypeStruct((N, k), jnp.float32), jax.ShapeDtypeStruct((N, k), jnp.int32)],
                  grid=(1,), interpret=interpret, num_warps=_WARPS, num_stages=1, name="moe_select_experts",
                  N=N, E=E, TOP_K=k, GROUPS=G, TOPK_GROUPS=cfg.topk_groups if G > 1 else 1,
                  BIAS_IN_WEIGHTS=bool(cfg.bias_in_weights), RENORMALIZE=bool(cfg.renormalize),
                  SCALE=float(cfg.routed_scaling_factor), BN=_pow2(N), BE=_pow2(E), BK=_pow2(k), BG=_pow2(G))
    return w, idx


@jit
def _plan_kernel(idx_ptr, src_ptr, tile_group_ptr, num_tiles_ptr, pad_row_ptr, N: tl.constexpr, E: tl.constexpr,
                 TOP_K: tl.constexpr, ROWS: tl.constexpr, T_MAX: tl.constexpr, BN: tl.constexpr,
                 BE: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, BM: tl.constexpr):
    n = tl.arange(0, BN)
    e = tl.arange(0, BE)
    kk = tl.arange(0, BK)
    row_ok = n < N
    expert_ok = e < E
    pairs = N * TOP_K
    idx = tl.load(idx_ptr + n[:, None] * TOP_K + kk[None, :], mask=row_ok[:, None] & (kk[None, :] < TOP_K),
                  other=-1)
    # routed[n, e]: how many of token n's slots chose expert e
    routed = tl.zeros((BN, BE), tl.int32)
    for j in tl.static_range(TOP_K):
        e_j = tl.sum(tl.where(kk[None, :] == j, idx, 0), axis=1)
        routed += (e[None, :] == e_j[:, None]).to(tl.int32)
    sizes = tl.sum(routed, axis=0)  # [BE]
    earlier = tl.cumsum(routed, axis=0) - routed  # [BN, BE]: pairs of earlier tokens with each expert
    tiles = (sizes + ROWS - 1) // ROWS
    tile_end = tl.cumsum(tiles, axis=0)
    row_start = ((tile_end - tiles) * ROWS)[None, :] + earlier  # [BN, BE]: token n's first padded row at e
    tl.store(num_tiles_ptr + tl.arange(0, 1), tl.sum(tiles, axis=0) + tl.zeros((1,), tl.int32))
    # each tile's expert: how many experts' tiles end at or before it (dead tiles: clamped to E - 1)
    for t0 in tl.static_range(0, T_MAX, BT):
        t = t0 + tl.arange(0, BT)
        ended = tl.sum(((tile_end[None, :] <= t[:, None]) & expert_ok[None, :]).to(tl.int32), axis=1)
        tl.store(tile_group_ptr + t, tl.minimum(ended, E - 1), mask=t < T_MAX)
    for m0 in tl.static_range(0, T_MAX * ROWS, BM):  # every padded row starts as "no pair"
        m = m0 + tl.arange(0, BM)
        tl.store(src_ptr + m, tl.full((BM,), pairs, tl.int32), mask=m < T_MAX * ROWS)
    tl.debug_barrier()  # the fill above lands before the pairs' rows below overwrite it
    for j in tl.static_range(TOP_K):
        e_j = tl.sum(tl.where(kk[None, :] == j, idx, 0), axis=1)
        same_before = tl.sum(((kk[None, :] < j) & (idx == e_j[:, None])).to(tl.int32), axis=1)
        row = tl.sum(tl.where(e[None, :] == e_j[:, None], row_start, 0), axis=1) + same_before
        pair = n * TOP_K + j
        tl.store(pad_row_ptr + pair, row, mask=row_ok)
        tl.store(src_ptr + row, pair, mask=row_ok)


def slot_tile_plan(expert_idx_nk, num_experts: int, rows: int, *, interpret: bool = False) -> TilePlan:
    """The tile plan of routed (token, slot) pairs, `expert_idx_nk [N, k]` int32 (each in [0, num_experts)) ->
    `TilePlan` (src `[t_max·rows]`, tile -> expert `[t_max]`, live tiles `[1]`, padded row of each pair `[N·k]`,
    live `[N·k]` all true; t_max = `schedule.tiles_bound(N·k, E, rows)`), as `rows.slot_tile_plan`. One program:
    `takes(N, num_experts)` must hold."""
    N, k = expert_idx_nk.shape
    E = num_experts
    if not takes(N, E):
        raise ValueError(f"slot_tile_plan: {N} tokens x {E} experts exceed one program ({MAX_ELEMENTS} elements)")
    pairs = N * k
    t_max = schedule.tiles_bound(pairs, E, rows)
    src, tile_group, num_tiles, pad_row = call(
        expert_idx_nk.astype(jnp.int32), kernel=_plan_kernel,
        out_shape=[jax.ShapeDtypeStruct((t_max * rows,), jnp.int32), jax.ShapeDtypeStruct((t_max,), jnp.int32),
                   jax.ShapeDtypeStruct((1,), jnp.int32), jax.ShapeDtypeStruct((pairs,), jnp.int32)],
        grid=(1,), interpret=interpret, num_warps=_WARPS, num_stages=1, name="moe_slot_tile_plan",
        N=N, E=E, TOP_K=k, ROWS=rows, T_MAX=t_max, BN=_pow2(N), BE=_pow2(E), BK=_pow2(k),
        BT=min(64, _pow2(t_max)), BM=min(1024, _pow2(t_max * rows)))
    return TilePlan(src, tile_group, num_tiles, pad_row, jnp.ones((pairs,), bool))
