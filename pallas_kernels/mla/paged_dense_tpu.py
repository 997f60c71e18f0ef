"""Pallas Mosaic-TPU kernel: dense (causal) MLA decode over the paged latent cache, whole pages per DMA.

Same contract as `paged_dense.dense_paged_mla` with T = 1 (its `reference` is the definition), for single-part row
formats (fp32, bf16, fp8 e4m3 with a per-layer scale).

Grid (B, n_steps), n_steps = ⌈max_blocks / pages_per_step⌉. The block table and the query positions are
scalar-prefetched into SMEM (4·B·(max_blocks + 1) bytes; a batch whose tables would not fit the SMEM budget is split
into several calls). Step (b, j) reads `pages_per_step` pages: each is its own operand whose BlockSpec index map
looks the page id up in the table, so the Pallas pipeline fetches each page `[page, c]` with one DMA while the
previous step computes. Pages past the query's last page map to that last page: the block index does not change,
so nothing is fetched again, and their compute is skipped. Inside a page, positions past the query are masked
(rows zeroed, logits −inf). fp32 online softmax in VMEM scratch (m, l `[H, 1]`, acc `[H, R]`); the per-layer fp8
scale is folded outside: logits use q·(scale·s) and the output is multiplied by s.

Checked on CPU in TPU interpret mode against the reference and exported for TPU (`jax.export`) at the presets'
dims; not yet run on TPU hardware (pages_per_step is the knob to tune there).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .. import budget
from .sparse_tpu import softmax_init, softmax_result, softmax_update

SUPPORTED = ("fp32", "bf16", "fp8")
ROWS_PER_STEP = 512  # default pages_per_step = ROWS_PER_STEP // page: ~0.6 MB of bf16 rows per step at c = 576


def supports(fmt, kv_parts=()) -> bool:
    return getattr(fmt, "kv_dtype", None) in SUPPORTED and len(kv_parts) <= 1


def default_pages_per_step(page: int, max_blocks: int) -> int:
    return int(max(1, min(max_blocks, ROWS_PER_STEP // max(1, page))))


def vmem_bytes(H: int, c: int, value_dim: int, page: int, pages_per_step: int, row_dtype) -> int:
    """VMEM of one call: double-buffered q `[H, c]` f32, pages `[page, c]`, o `[H, R]` and lse `[H, 1]` blocks, plus
    the m, l, acc scratch."""
    f32 = np.float32
    return (2 * (budget.tile_bytes((H, c), f32) + pages_per_step * budget.tile_bytes((page, c), row_dtype)
                 + budget.tile_bytes((H, value_dim), f32) + budget.tile_bytes((H, 1), f32))
            + 2 * budget.tile_bytes((H, 1), f32) + budget.tile_bytes((H, value_dim), f32))


def smem_bytes_per_row(max_blocks_padded: int) -> int:
    """SMEM of one batch row's tables: its block-table row and its query position (int32)."""
    return 4 * (max_blocks_padded + 1)


def _kernel(bt_ref, pos_ref, q_ref, *refs, pages_per_step: int, page: int, value_dim: int):
    page_refs = refs[:pages_per_step]
    o_ref, lse_ref, m_sc, l_sc, acc_sc = refs[pages_per_step:]
    b = pl.program_id(0)
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        softmax_init(m_sc, l_sc, acc_sc)

    pos = pos_ref[b]
    q = q_ref[...]  # [H, c] float32, already times scale·layer_scale
    for i in range(pages_per_step):
        first = (j * pages_per_step + i) * page

        @pl.when(first <= pos)
        def _page(i=i, first=first):
            t_row = first + jax.lax.broadcasted_iota(jnp.int32, (page, 1), 0)
            rows = jnp.where(t_row <= pos, page_refs[i][...].astype(jnp.float32), 0.0)  # [page, c]
            s = jax.lax.dot_general(q, rows, (((1,), (1,)), ((), ())), precision=jax.lax.Precision.HIGHEST,
                                    preferred_element_type=jnp.float32)  # [H, page]
            t_col = first + jax.lax.broadcasted_iota(jnp.int32, (1, page), 1)
            softmax_update(m_sc, l_sc, acc_sc, jnp.where(t_col <= pos, s, -jnp.inf), rows[:, :value_dim])

    @pl.when(j == pl.num_programs(1) - 1)
    def _finish():
        o_ref[...], lse_ref[...] = softmax_result(m_sc, l_sc, acc_sc)


def _call(q_bhc, *, pool, bt, pos, page: int, pages_per_step: int, value_dim: int, interpret: bool):
    B, H, c = q_bhc.shape
    width = bt.shape[1]  # a multiple of pages_per_step
    n_steps = width // pages_per_step

    def page_spec(i):
        def index_map(b, j, bt_s, pos_s):
            last = jax.lax.div(jnp.maximum(pos_s[b], 0), page)  # pos ≥ 0 here: no floor-division sign op
            return bt_s[b * width + jnp.minimum(j * pages_per_step + i, last)], 0, 0

        return pl.BlockSpec((None, page, c), index_map)

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(B, n_steps),
        in_specs=[pl.BlockSpec((None, H, c), lambda b, j, *_: (b, 0, 0))]
                 + [page_spec(i) for i in range(pages_per_step)],
        out_specs=[pl.BlockSpec((None, H, value_dim), lambda b, j, *_: (b, 0, 0)),
                   pl.BlockSpec((None, H, 1), lambda b, j, *_: (b, 0, 0))],
        scratch_shapes=[pltpu.VMEM((H, 1), jnp.float32), pltpu.VMEM((H, 1), jnp.float32),
                        pltpu.VMEM((H, value_dim), jnp.float32)],
    )
    return pl.pallas_call(
        functools.partial(_kernel, pages_per_step=pages_per_step, page=page, value_dim=value_dim),
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((B, H, value_dim), jnp.float32),
                   jax.ShapeDtypeStruct((B, H, 1), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="mla_paged_dense_decode_tpu",
    )(bt.reshape(-1), pos, q_bhc, *([pool] * pages_per_step))


@functools.partial(jax.jit, static_argnames=("fmt", "scale", "value_dim", "pages_per_step", "smem_budget",
                                             "interpret"))
def decode(q_bhc, kv_parts, block_tables, pos_b, *, fmt, scale: float, value_dim: int, layer_scale=1.0,
           pages_per_step=None, smem_budget: int = budget.SMEM_BUDGET, interpret: bool = False):
    """q `[B, H, c]`, kv_parts `(rows [num_blocks, page, c],)`, block_tables `[B, max_blocks]` int32, pos `[B]` int32
    (attend to positions 0 … pos; < 0 = padding) -> (o `[B, H, value_dim]` float32, lse `[B, H]` float32).
    `pages_per_step` (default `ROWS_PER_STEP // page`); `smem_budget`: bytes of scalar tables per call (the batch
    is split into calls that fit)."""
    if not supports(fmt, kv_parts):
        raise ValueError(f"the TPU dense paged MLA kernel reads single-part {SUPPORTED} rows, not {fmt}")
    (pool,) = kv_parts
    nblocks, page, c = pool.shape
    B, H, _ = q_bhc.shape
    if B == 0:
        return jnp.zeros((0, H, value_dim), jnp.float32), jnp.zeros((0, H), jnp.float32)
    max_blocks = block_tables.shape[1]
    pps = pages_per_step or default_pages_per_step(page, max_blocks)
    width = -(-max_blocks // pps) * pps
    budget.check("dense paged MLA (TPU)", vmem=vmem_bytes(H, c, value_dim, page, pps, pool.dtype), smem=0)
    rows_per_call = budget.batch_rows_within(B, smem_bytes_per_row(width), smem_budget=smem_budget)
    # out-of-range table entries (unused slots) are clamped to a real page: they are never read past the mask
    bt = jnp.clip(jnp.asarray(block_tables, jnp.int32), 0, nblocks - 1)
    bt = jnp.pad(bt, ((0, 0), (0, width - max_blocks)))
    pos = jnp.asarray(pos_b, jnp.int32)
    ls = jnp.asarray(layer_scale if fmt.kv_dtype == "fp8" else 1.0, jnp.float32)  # fp32 / bf16 rows are unscaled
    q = q_bhc.astype(jnp.float32) * (scale * ls)
    call = functools.partial(_call, pool=pool, page=page, pages_per_step=pps, value_dim=value_dim,
                             interpret=interpret)
    o, lse = budget.over_batch(lambda q, bt, pos: call(q, bt=bt, pos=pos), B, rows_per_call, q, bt, pos)
    return o * ls, lse[..., 0]
