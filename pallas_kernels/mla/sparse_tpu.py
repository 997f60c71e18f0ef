"""Pallas Mosaic-TPU kernel: sparse MLA decode over the paged latent cache (one query per sequence).

Same contract as `sparse.sparse_mla` with T = 1, for single-part row formats (bf16, fp8 e4m3 with a per-layer scale).
Grid (B, k / block_k): for each sequence and block of top-k slots the kernel reads the slot positions from SMEM
(scalar prefetch: flattened block tables and indices), DMAs the block_k selected rows `[c]` from the HBM pool into a
VMEM buffer (one row per DMA, all started before the first wait), and runs an fp32 online softmax over blocks in
VMEM scratch (m, l `[H, 1]`, acc `[H, R]`). Empty slots (idx < 0) get an additive −inf bias. The per-layer fp8
scale is folded outside the kernel: logits use q·(scale·s) and the output is multiplied by s.

SMEM: the prefetched tables take 4·(k + max_blocks) bytes per sequence; a batch whose tables exceed the SMEM budget
(`pallas_kernels.budget`; e.g. B = 256 × (k 2048 + 2048 blocks) = 4 MiB) runs as several calls over batch slices.
VMEM: `vmem_bytes` (≈ 0.6 MiB at H = 96, c = 576, block_k = 128).

Checked on CPU in TPU interpret mode (`interpret=True` -> `pltpu.InterpretParams()`) against the jnp reference and
exported for TPU (`jax.export`). Not yet run on TPU hardware: block_k and the per-row DMAs (c = 576 is not a multiple
of 128 lanes) need tuning there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .. import budget

SUPPORTED = ("bf16", "fp8")


def vmem_bytes(H: int, c: int, value_dim: int, block_k: int, row_dtype) -> int:
    """VMEM of one call: double-buffered q `[H, c]`, bias `[1, bk]`, o `[H, R]`, lse `[H, 1]` blocks, the rows buffer
    `[bk, c]` and the m, l, acc scratch (float32 but the rows)."""
    f32 = np.float32
    return (2 * (budget.tile_bytes((H, c), f32) + budget.tile_bytes((1, block_k), f32)
                 + budget.tile_bytes((H, value_dim), f32) + budget.tile_bytes((H, 1), f32))
            + budget.tile_bytes((block_k, c), row_dtype) + 2 * budget.tile_bytes((H, 1), f32)
            + budget.tile_bytes((H, value_dim), f32))


def smem_bytes_per_row(k_pad: int, max_blocks: int) -> int:
    """SMEM of one sequence's prefetched tables: its block-table row and its top-k positions (int32)."""
    return 4 * (k_pad + max_blocks)


def supports(fmt) -> bool:
    return getattr(fmt, "kv_dtype", None) in SUPPORTED


def softmax_init(m_sc, l_sc, acc_sc):
    """Empty online-softmax scratch of the MLA TPU kernels: running max and sum `[H, 1]`, weighted values `[H, R]`."""
    m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)


def softmax_update(m_sc, l_sc, acc_sc, s_hj, values_jr):
    """Fold one block of logits `[H, j]` float32 (−inf = no key) and its values `[j, R]` into the scratch."""
    m_prev = m_sc[...]
    m_new = jnp.maximum(m_prev, jnp.max(s_hj, axis=-1, keepdims=True))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp(s_hj - m_use)
    corr = jnp.exp(m_prev - m_use)
    l_sc[...] = l_sc[...] * corr + jnp.sum(p, axis=-1, keepdims=True)
    acc_sc[...] = acc_sc[...] * corr + jax.lax.dot_general(
        p, values_jr, (((1,), (0,)), ((), ())), precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32)
    m_sc[...] = m_new


def softmax_result(m_sc, l_sc, acc_sc):
    """(o `[H, R]`, lse `[H, 1]`) of the scratch; a query with no key gets o = 0 and lse = −inf."""
    l = l_sc[...]
    ok = l > 0
    return (acc_sc[...] / jnp.where(ok, l, 1.0),
            jnp.where(ok, m_sc[...] + jnp.log(jnp.where(ok, l, 1.0)), -jnp.inf))


def _kernel(bt_ref, idx_ref, q_ref, bias_ref, pool_hbm, o_ref, lse_ref, rows_vmem, sems, m_sc, l_sc, acc_sc, *,
            block_k: int, k_pad: int, max_blocks: int, page: int, value_dim: int):
    b = pl.program_id(0)
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        softmax_init(m_sc, l_sc, acc_sc)

    def row_copy(i, slot):
        return pltpu.make_async_copy(pool_hbm.at[pl.ds(slot, 1)], rows_vmem.at[pl.ds(i, 1)], sems.at[i])

    def start(i, carry):
        pos = jnp.maximum(idx_ref[b * k_pad + j * block_k + i], 0)
        # lax.div / lax.rem (truncating) on pos ≥ 0: jnp's floor `//` and `%` lower through sign(), which Mosaic
        # resolves by asking the device for its TPU generation, so the kernel could not be exported without a TPU
        blk = bt_ref[b * max_blocks + jnp.minimum(jax.lax.div(pos, page), max_blocks - 1)]
        row_copy(i, blk * page + jax.lax.rem(pos, page)).start()
        return carry

    def wait(i, carry):
        row_copy(i, 0).wait()  # a wait needs only the semaphore and the destination shape
        return carry

    jax.lax.fori_loop(0, block_k, start, 0)
    jax.lax.fori_loop(0, block_k, wait, 0)

    rows = rows_vmem[...].astype(jnp.float32)  # [bk, c]
    q = q_ref[0].astype(jnp.float32)  # [H, c], already times scale·layer_scale
    s = jax.lax.dot_general(q, rows, (((1,), (1,)), ((), ())), precision=jax.lax.Precision.HIGHEST,
                            preferred_element_type=jnp.float32)
    softmax_update(m_sc, l_sc, acc_sc, s + bias_ref[0, 0], rows[:, :value_dim])  # logits [H, bk] + [1, bk]

    @pl.when(j == pl.num_programs(1) - 1)
    def _finish():
        o_ref[0], lse_ref[0] = softmax_result(m_sc, l_sc, acc_sc)


@functools.partial(jax.jit, static_argnames=("fmt", "scale", "value_dim", "block_k", "smem_budget", "interpret"))
def decode(q_bhc, kv_parts, block_tables, idx_bk, *, fmt, scale: float, value_dim: int, layer_scale=1.0,
           block_k: int = 128, smem_budget: int = budget.SMEM_BUDGET, interpret: bool = False):
    """q `[B, H, c]`, kv_parts `(rows [num_blocks, page, c],)`, block_tables `[B, max_blocks]`, idx `[B, k]`
    -> (o `[B, H, value_dim]` float32, lse `[B, H]` float32). The batch runs in slices whose tables fit
    `smem_budget` bytes of SMEM."""
    if not supports(fmt):
        raise ValueError(f"the TPU sparse MLA kernel reads {SUPPORTED} rows, not {fmt}")
    (pool,) = kv_parts
    nblocks, page, c = pool.shape
    B, H, _ = q_bhc.shape
    k = idx_bk.shape[-1]
    bk = max(1, min(block_k, k))
    n = -(-k // bk)
    k_pad = n * bk
    idx = jnp.pad(jnp.asarray(idx_bk, jnp.int32), ((0, 0), (0, k_pad - k)), constant_values=-1)
    bias = jnp.where(idx >= 0, 0.0, -jnp.inf).astype(jnp.float32).reshape(B, n, 1, bk)
    bt = jnp.asarray(block_tables, jnp.int32)
    max_blocks = bt.shape[1]
    ls = jnp.asarray(layer_scale if fmt.kv_dtype == "fp8" else 1.0, jnp.float32)  # bf16 rows are unscaled
    q = q_bhc.astype(jnp.float32) * (scale * ls)

    budget.check("sparse MLA (TPU)", vmem=vmem_bytes(H, c, value_dim, bk, pool.dtype), smem=0)
    rows_per_call = budget.batch_rows_within(B, smem_bytes_per_row(k_pad, max_blocks), smem_budget=smem_budget)

    def call(q, bias, bt, idx):
        Bc = q.shape[0]
        kernel = functools.partial(_kernel, block_k=bk, k_pad=k_pad, max_blocks=max_blocks, page=page,
                                   value_dim=value_dim)
        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(Bc, n),
            in_specs=[
                pl.BlockSpec((1, H, c), lambda b, j, *_: (b, 0, 0)),
                pl.BlockSpec((1, 1, 1, bk), lambda b, j, *_: (b, j, 0, 0)),
                pl.BlockSpec(memory_space=pl.ANY),
            ],
            out_specs=[
                pl.BlockSpec((1, H, value_dim), lambda b, j, *_: (b, 0, 0)),
                pl.BlockSpec((1, H, 1), lambda b, j, *_: (b, 0, 0)),
            ],
            scratch_shapes=[
                pltpu.VMEM((bk, c), pool.dtype),
                pltpu.SemaphoreType.DMA((bk,)),
                pltpu.VMEM((H, 1), jnp.float32),
                pltpu.VMEM((H, 1), jnp.float32),
                pltpu.VMEM((H, value_dim), jnp.float32),
            ],
        )
        return pl.pallas_call(
            kernel,
            grid_spec=grid_spec,
            name="mla_sparse_decode_tpu",
            out_shape=[jax.ShapeDtypeStruct((Bc, H, value_dim), jnp.float32),
                       jax.ShapeDtypeStruct((Bc, H, 1), jnp.float32)],
            compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
            interpret=pltpu.InterpretParams() if interpret else False,
        )(bt.reshape(-1), idx.reshape(-1), q, bias, pool.reshape(nblocks * page, c))

    o, lse = budget.over_batch(call, B, rows_per_call, q, bias, bt, idx)
    return o * ls, lse[..., 0]
