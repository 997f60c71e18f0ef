"""KDA kernels for TPU (Pallas Mosaic TPU): chunked prefill and slot-addressed recurrent decode.

Tested on CPU in TPU interpret mode (`interpret=True` → `pltpu.InterpretParams()`). Every block keeps its last two
dims either (8, 128)-divisible or equal to the array's, and no kernel reshapes between lanes and sublanes: rows are
picked with masks, transposes are done by matmuls (exact at HIGHEST precision, one nonzero term per output).

Cost on paper (v5p-class chip, H=96, d=128, bf16, per token per layer): prefill reads q, k, v (2 B), g (4 B), β and
writes o: ≈ 0.15 MB/token, ≈ 17 MFLOP/token of matmul (≈ 11 M of it the WY/state products, the rest the exact
transposes and sub-block products); decode reads and writes the 6 MiB state per sequence: bandwidth-bound.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_kernels.kda.chunk_math as M  # not `from . import`: see kda/ops.py

HP = jax.lax.Precision.HIGHEST
C = 64
_dot = M.make_dot(HP)


def _interpret_arg(interpret):
    if not interpret:
        return False
    if hasattr(pltpu, "InterpretParams"):
        return pltpu.InterpretParams()
    return True


def _compiler_params(sem):
    cls = getattr(pltpu, "CompilerParams", None) or getattr(pltpu, "TPUCompilerParams")
    return cls(dimension_semantics=sem)


def _cumsum0(x):
    n = x.shape[0]
    tril = (jax.lax.broadcasted_iota(jnp.int32, (n, n), 0) >= jax.lax.broadcasted_iota(jnp.int32, (n, n), 1))
    return _dot(tril.astype(jnp.float32), x)


def _row_scale(S, d_row):
    return M.scale_rows(S, d_row, _dot)


# ------------------------------------------------------------------------------------------------------------------
# chunked prefill
# ------------------------------------------------------------------------------------------------------------------

def _chunk_kernel(seq_ref, first_ref, q_ref, k_ref, v_ref, g_ref, b_ref, s0_ref, o_ref, sf_ref, s_scr, *, scale):
    j = pl.program_id(1)

    @pl.when(first_ref[j] == 1)
    def _():
        s_scr[...] = s0_ref[...]

    NS = C // M.SUB
    blk = lambda ref, i: ref[i * M.SUB:(i + 1) * M.SUB, :].astype(jnp.float32)
    qb = [blk(q_ref, i) * scale for i in range(NS)]
    kb = [blk(k_ref, i) for i in range(NS)]
    vb = [blk(v_ref, i) for i in range(NS)]
    gb = [blk(g_ref, i) for i in range(NS)]
    bb = [blk(b_ref, i) for i in range(NS)]
    intra = M.intra_chunk(qb, kb, vb, gb, bb, dot=_dot, cumsum0=_cumsum0)
    O, S_new = M.chunk_state_step(intra, s_scr[...], dot=_dot, row_scale=_row_scale)
    for i in range(NS):
        o_ref[i * M.SUB:(i + 1) * M.SUB, :] = O[i].astype(o_ref.dtype)
    s_scr[...] = S_new
    sf_ref[...] = S_new


def chunk(q, k, v, g, beta, cu_seqlens, initial_state=None, scale=None, interpret=False):
    """Packed prefill. q, k, g `[1, Ttot, H, dk]`, v `[1, Ttot, H, dv]`, beta `[1, Ttot, H]`, cu_seqlens `[N+1]`.

    Returns (o `[1, Ttot, H, dv]` in v.dtype, final states `[N, H, dk, dv]` float32).
    """
    _, Tt, H, dk = q.shape
    dv = v.shape[-1]
    scale = dk ** -0.5 if scale is None else scale
    tab = M.chunk_table(cu_seqlens, Tt, C)
    N = tab.seq_chunk0.shape[0]
    NCH = tab.n_chunks
    # gather into chunk-aligned, zero-padded, head-major blocks [H, NCH, C, d]
    pos = tab.start[:, None] + jnp.arange(C, dtype=jnp.int32)[None, :]
    valid = jnp.arange(C)[None, :] < tab.length[:, None]
    pos = jnp.where(valid, pos, 0)

    def to_blocks(x, dtype=None):
        y = x[0][pos]  # [NCH, C, H, ...]
        y = jnp.where(valid.reshape(valid.shape + (1,) * (y.ndim - 2)), y, 0)
        if dtype is not None:
            y = y.astype(dtype)
        return jnp.moveaxis(y, 2, 0)  # [H, NCH, C, ...]

    qp, kp, vp = to_blocks(q), to_blocks(k), to_blocks(v)
    gp = to_blocks(g, jnp.float32)
    bp = to_blocks(beta, jnp.float32)[..., None]  # [H, NCH, C, 1]
    s0 = (jnp.zeros((N, H, dk, dv), jnp.float32) if initial_state is None
          else initial_state.astype(jnp.float32))

    tok = lambda d: pl.BlockSpec((None, None, C, d), lambda h, j, seq, first: (h, j, 0, 0))
    st = pl.BlockSpec((None, None, dk, dv), lambda h, j, seq, first: (seq[j], h, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(H, NCH),
        in_specs=[tok(dk), tok(dk), tok(dv), tok(dk), tok(1), st],
        out_specs=[tok(dv), st],
        scratch_shapes=[pltpu.VMEM((dk, dv), jnp.float32)],
    )
    o_p, s_f = pl.pallas_call(
        functools.partial(_chunk_kernel, scale=scale),
        grid_spec=grid_spec,
        name="kda_chunk_tpu",
        out_shape=[jax.ShapeDtypeStruct((H, NCH, C, dv), v.dtype),
                   jax.ShapeDtypeStruct((N, H, dk, dv), jnp.float32)],
        compiler_params=_compiler_params(("parallel", "arbitrary")),
        interpret=_interpret_arg(interpret),
    )(tab.seq, tab.first, qp, kp, vp, gp, bp, s0)
    # scatter back: token t of chunk j sits at o_p[:, j, t - start[j]]
    t = jnp.arange(Tt, dtype=jnp.int32)
    j_of_t = jnp.clip(jnp.searchsorted(tab.start, t, side="right") - 1, 0, NCH - 1)
    o = o_p[:, j_of_t, t - tab.start[j_of_t]]  # [H, Tt, dv]
    o = jnp.moveaxis(o, 0, 1)[None]
    # empty sequences have no chunk: their final state is their initial state
    s_f = jnp.where((tab.seq_nchunks > 0)[:, None, None, None], s_f, s0)
    return o, s_f


# ------------------------------------------------------------------------------------------------------------------
# recurrent decode against a state pool
# ------------------------------------------------------------------------------------------------------------------

def _decode_kernel(slot_ref, q_ref, k_ref, v_ref, g_ref, b_ref, a_ref, dtb_ref, pool_ref, o_ref, pool_out_ref, *,
                   scale, n_steps, gate_form, lower_bound):
    """One (sequence b, head h): q, k, g `[Tp, dk]`, v `[Tp, dv]`, beta `[Tp, 1]`, dt_bias `[1, dk]`, A_log [H] in
    SMEM, the state `[dk, dv]` float32."""
    del slot_ref
    h = pl.program_id(1)
    Tp, dk = q_ref.shape
    q = q_ref[...].astype(jnp.float32) * scale
    k = k_ref[...].astype(jnp.float32)
    v = v_ref[...].astype(jnp.float32)
    g = g_ref[...].astype(jnp.float32)
    if gate_form is not None:
        g = M.gate_value(g, jnp.exp(a_ref[h]), dtb_ref[...].astype(jnp.float32), gate_form, lower_bound)
    b = b_ref[...].astype(jnp.float32)  # [Tp, 1]
    rows_k = jax.lax.broadcasted_iota(jnp.int32, (Tp, dk), 0)
    rows_v = jax.lax.broadcasted_iota(jnp.int32, v.shape, 0)
    rows_1 = jax.lax.broadcasted_iota(jnp.int32, b.shape, 0)

    def step(t, carry):
        S, o = carry
        kt = jnp.where(rows_k == t, k, 0.0)
        vt = jnp.where(rows_v == t, v, 0.0)
        bt = jnp.where(rows_1 == t, b, 0.0)
        gt = jnp.sum(jnp.where(rows_k == t, g, 0.0), axis=0, keepdims=True)
        S = _row_scale(S, jnp.exp(gt))
        u = bt * (vt - _dot(kt, S))  # only row t is nonzero
        S = S + _dot(kt, u, trans_a=True)
        o = o + _dot(jnp.where(rows_k == t, q, 0.0), S)
        return S, o

    S, o = jax.lax.fori_loop(0, n_steps, step, (pool_ref[...], jnp.zeros(v.shape, jnp.float32)))
    o_ref[...] = o.astype(o_ref.dtype)
    pool_out_ref[...] = S


def recurrent(q, k, v, g, beta, state_pool, slot_ids, scale=None, *, A_log=None, dt_bias=None, gate_form=None,
              lower_bound=-5.0, interpret=False):
    """Decode T (usually 1) tokens for B sequences against `state_pool[slot_ids]` `[S, H, dk, dv]` float32.

    With `gate_form` set, `g` is the raw forget projection f and the gate is computed in the kernel from
    `A_log [H]` and `dt_bias [H*dk]`. Returns (o `[B, T, H, dv]`, pool) with the pool updated in place when the
    caller donates it (input_output_aliases).
    """
    B, T, H, dk = q.shape
    dv = v.shape[-1]
    scale = dk ** -0.5 if scale is None else scale
    Tp = -(-T // 8) * 8
    # head-major `[B, H, Tp, d]`: every block `(Tp, d)` is (8, ·)-divisible in rows and the whole last dim, so it is
    # legal for any head dim (a `(Tp, d)` slice of `[B, Tp, H·d]` is not when d is not a multiple of 128)
    heads = lambda x: jnp.pad(jnp.moveaxis(x, 2, 1), [(0, 0), (0, 0), (0, Tp - T), (0, 0)])
    q2, k2, v2, g2 = heads(q), heads(k), heads(v), heads(g)
    b2 = heads(beta[..., None])  # [B, H, Tp, 1]
    if gate_form is None:
        a = jnp.zeros((H,), jnp.float32)
        dtb = jnp.zeros((H, 1, dk), jnp.float32)
    else:
        a = jnp.asarray(A_log, jnp.float32).reshape(H)
        dtb = jnp.asarray(dt_bias, jnp.float32).reshape(H, 1, dk)
    tok = lambda d: pl.BlockSpec((None, None, Tp, d), lambda b, h, slot: (b, h, 0, 0))
    pool_spec = pl.BlockSpec((None, None, dk, dv), lambda b, h, slot: (slot[b], h, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(B, H),
        in_specs=[tok(dk), tok(dk), tok(dv), tok(dk), tok(1),
                  pl.BlockSpec(memory_space=pltpu.SMEM),
                  pl.BlockSpec((None, 1, dk), lambda b, h, slot: (h, 0, 0)),
                  pool_spec],
        out_specs=[tok(dv), pool_spec],
    )
    o, pool = pl.pallas_call(
        functools.partial(_decode_kernel, scale=scale, n_steps=T, gate_form=gate_form, lower_bound=lower_bound),
        grid_spec=grid_spec,
        name="kda_recurrent_tpu",
        out_shape=[jax.ShapeDtypeStruct((B, H, Tp, dv), v.dtype),
                   jax.ShapeDtypeStruct(state_pool.shape, jnp.float32)],
        input_output_aliases={8: 1},  # operand 8 counts the scalar-prefetch slot ids
        compiler_params=_compiler_params(("parallel", "parallel")),
        interpret=_interpret_arg(interpret),
    )(slot_ids.astype(jnp.int32), q2, k2, v2, g2, b2, a, dtb, state_pool.astype(jnp.float32))
    return jnp.moveaxis(o[:, :, :T], 1, 2), pool
