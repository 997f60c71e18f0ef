"""The sparse MLA Mosaic GPU kernel itself (`kernel_call`), its entry `decode` and the split merge `merge`; what
the kernel computes and how its jobs divide into modules: the package docstring (`sparse_mgpu/__init__.py`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.mla.sparse_gpu_triton import merge_splits
from .config import CHUNK, HEADS, KEYS, MgpuSparseConfig, P_SCALE, row_stride, supports
from .gather import _init_barriers_fn, _stamp_fn, _translate_fn, _wait_fn, issue_fn
from .operands import (_logits_operand_fn, _logits_operand_fp8_fn, _store_p_fp8_fn, _value_operand_fn,
                       _value_operand_fp8_fn)
from .prep import _q_fp8_transforms, _q_transforms, prepare_q, prepare_q_fp8, prepare_slots
from .softmax import _combine_fn, _finish_fn, _init_stats_fn, _last_merge_fn, _prep_q_fn, _softmax_fn


def kernel_call(q, c2, slots, block_tables, pool_u8, *, R: int, page: int,
                config: MgpuSparseConfig = MgpuSparseConfig(), H: int = HEADS, layer_scale=1.0, scale=None,
                trace: bool = False):
    """The Mosaic GPU kernel alone: q `[B, 16, c]` f16 and c2 `[B, 16]` f32 (`prepare_q`) — or, with
    `prep="kernel"`, the raw q `[B, H, c]` f32 / bf16, c2 None and the logit `scale` (the layer scale multiplies
    it) —, slots `[B, splits, n_blk, 64]` int32 positions (`prepare_slots`; n_blk a multiple of the warpgroups),
    block_tables `[B, max_blocks]` int32, pool `[num_blocks · page, c]` uint8 (fp8 bits) -> (o `[splits, B, 16, R]`
    f32 normalised per split, lse `[splits, B, 16]` f32); with `merge="last"` the merged result instead: (o
    `[B, H, R]` f32 · layer_scale, lse `[B, H]` f32) for the first H heads. `trace=True` (a diagnostic) appends
    each CTA warpgroup's timeline `[splits, B, warpgroups, 5 + 2 · blocks per warpgroup]` int32 (`_stamp_fn`,
    read with `trace_phases`)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    B, _, c = (q[0] if isinstance(q, tuple) else q).shape
    _, NS, n_blk, _ = slots.shape
    max_blocks = block_tables.shape[1]
    nblocks = pool_u8.shape[0] // page
    cfg = config
    S, LC, VK, NW = cfg.stages, cfg.logits_chunk, cfg.value_keys, cfg.warpgroups
    NA = max(1, min(cfg.logits_accs, c // LC))
    if c % LC or LC % CHUNK or KEYS % VK or VK % 16 or R % 128 or R > c:
        raise ValueError(f"mgpu sparse MLA: row width {c} must be a multiple of logits_chunk {LC} (a multiple of "
                         f"{CHUNK}); value_keys {VK} must divide {KEYS} (multiple of 16); R {R}")
    if NW not in (1, 2, 4) or n_blk % NW:
        raise ValueError(f"warpgroups {NW} must be 1, 2 or 4 and divide the blocks per split {n_blk}")
    if cfg.merge not in ("kernel", "last"):
        raise ValueError(f"merge must be 'kernel' or 'last', got {cfg.merge!r}")
    if cfg.prep not in ("xla", "kernel"):
        raise ValueError(f"prep must be 'xla' or 'kernel', got {cfg.prep!r}")
    last, qk = cfg.merge == "last", cfg.prep == "kernel"
    chunk_wait = cfg.mma_wait == "chunk"
    f8 = cfg.logits_mma == "fp8"
    if cfg.logits_mma not in ("f16", "fp8") or (f8 and qk):
        raise ValueError(f"logits_mma must be 'f16' or 'fp8' (fp8 with prep='xla'), got {cfg.logits_mma!r}")
    v8 = cfg.value_mma == "fp8"
    if cfg.value_mma not in ("f16", "fp8"):
        raise ValueError(f"value_mma must be 'f16' or 'fp8', got {cfg.value_mma!r}")
    if f8 != (isinstance(q, tuple)):
        raise ValueError("logits_mma='fp8' takes q as the (q_hi, q_lo) planes of `prepare_q_fp8`")
    q, q_lo = q if f8 else (q, None)  # fp8 logits: q's hi plane goes where the f16 q would, lo beside it
    if qk and (c2 is not None or scale is None or q.shape[1] != H or q.dtype not in (jnp.float32, jnp.bfloat16)):
        raise ValueError("prep='kernel' takes the raw q [B, H, c] (f32 or bf16), c2=None and the logit scale")
    stride = row_stride(c)
    wg_bytes = S * KEYS * stride  # one warpgroup's stages
    if NW > 1 and wg_bytes < 4 * HEADS * R:
        raise ValueError(f"{S} stage(s) of {KEYS} rows cannot hold a warpgroup's partial o ({4 * HEADS * R} bytes)")
    nb_w = n_blk // NW  # blocks per warpgroup
    lead = (NW,) if NW > 1 else ()  # the scratch's warpgroup axis
    wg_ty = plgpu.Layout.WGMMA
    splat = plgpu.Layout.WG_SPLAT
    ref = plgpu.RefType()
    f32_acc = plgpu.ShapeDtypeStruct((KEYS, HEADS), jnp.float32, layout=wg_ty)
    init_barriers = plgpu.inline_mgpu(arg_types=(ref,))(_init_barriers_fn(S))
    q_ref_ty = plgpu.RefType(transforms=_q_transforms())
    prep_q = plgpu.inline_mgpu(arg_types=(ref, q_ref_ty, ref, ref) + (splat,) * (NW > 1))(_prep_q_fn(c, H, NW))
    translate = plgpu.inline_mgpu(arg_types=(ref, ref) + ((splat,) if NW > 1 else ()))(
        _translate_fn(nb_w, NW, page, nblocks, max_blocks))
    issue = plgpu.inline_mgpu(arg_types=(ref,) * 4)(issue_fn(config.gather)(c, stride))
    wait = plgpu.inline_mgpu(arg_types=(ref, splat))(_wait_fn())
    if f8:
        f8_ty = plgpu.ShapeDtypeStruct((KEYS, 32), jnp.float8_e4m3fn, layout=plgpu.Layout.WGMMA_8BIT)
        logits_a = [plgpu.inline_mgpu(arg_types=(ref,), return_type=(f8_ty,) * (LC // 32))(
            _logits_operand_fp8_fn(j * LC, LC)) for j in range(c // LC)]
    else:
        logits_a = [plgpu.inline_mgpu(arg_types=(ref,),
                                      return_type=plgpu.ShapeDtypeStruct((KEYS, LC), jnp.float16, layout=wg_ty))(
            _logits_operand_fn(j * LC, LC)) for j in range(c // LC)]
    if v8:
        v8_ty = plgpu.ShapeDtypeStruct((R, 32), jnp.float8_e4m3fn, layout=plgpu.Layout.WGMMA_8BIT)
        value_a = [plgpu.inline_mgpu(arg_types=(ref,), return_type=v8_ty)(_value_operand_fp8_fn(R, g))
                   for g in range(KEYS // 32)]
        p8_ref = plgpu.RefType(transforms=_q_fp8_transforms())
        store_p = plgpu.inline_mgpu(arg_types=(wg_ty, p8_ref, p8_ref))(_store_p_fp8_fn())
    else:
        value_a = [plgpu.inline_mgpu(arg_types=(ref,),
                                     return_type=plgpu.ShapeDtypeStruct((R, VK), jnp.float16, layout=wg_ty))(
            _value_operand_fn(R, j * VK, VK)) for j in range(KEYS // VK)]
    softmax = plgpu.inline_mgpu(
        arg_types=(wg_ty, wg_ty, wg_ty, ref, ref, ref),
        return_type=(plgpu.ShapeDtypeStruct((KEYS, HEADS), jnp.float32 if v8 else jnp.float16, layout=wg_ty),
                     f32_acc, plgpu.ShapeDtypeStruct((R, HEADS), jnp.float32, layout=wg_ty)))(_softmax_fn(R, v8))
    init_stats = plgpu.inline_mgpu(return_type=f32_acc)(_init_stats_fn())
    finish = plgpu.inline_mgpu(arg_types=(wg_ty, wg_ty, ref, ref, ref))(
        _finish_fn(R, to_smem=NW > 1, out_scale=1 / P_SCALE if v8 else 1.0))
    combine = plgpu.inline_mgpu(arg_types=(ref, ref, ref, ref, splat))(_combine_fn(R, NW, wg_bytes))
    last_merge = plgpu.inline_mgpu(arg_types=(ref,) * 7 + (splat,) * (NW > 1))(_last_merge_fn(R, NS, NW, H))
    stamp_at = plgpu.inline_mgpu(arg_types=(ref, splat))(_stamp_fn())

    def sparse_mla_mgpu(*refs, q_smem, idx_smem, c2_smem, rows_smem, p_smem, red_smem, bar_smem, q_bar, idx_bar,
                        lse_parts=None, done_bar=None, flag_smem=None, qraw_smem=None, q_lo_smem=None):
        refs = list(refs)
        trace_ref = refs.pop() if trace else None
        slots_ref, bt_ref, q_ref = refs[:3]
        q_lo_ref = refs.pop(3) if f8 else None
        c2_ref = None if qk else refs.pop(3)
        pool_ref = refs[3]
        # prep="kernel" / merge="last": the scalars (logit scale, layer scale); "last": the per-sequence counters (a
        # mutable ref) in, the merged result out
        sc_ref = refs.pop(4) if qk or last else None
        cnt_ref = refs.pop(4) if last else None
        o_ref, lse_ref, o_fin, lse_fin = refs[4:] if last else (*refs[4:], None, None)
        sp = jax.lax.axis_index("s")
        b = jax.lax.axis_index("b")
        wg = jax.lax.axis_index("wg") if NW > 1 else 0
        wg_arg = (wg.astype(jnp.int32),) if NW > 1 else ()

        def mine(r):  # this warpgroup's part of a scratch (one warpgroup: the scratch has no warpgroup axis — a
            return r.at[wg] if NW > 1 else r  # literal index 0 does not lower inside run_state)

        rows_wg, p_wg, red_wg, bar_wg = mine(rows_smem), mine(p_smem), mine(red_smem), mine(bar_smem)

        def stamp(pos):  # the timeline (trace=True): position pos of this CTA warpgroup's row
            if trace:
                stamp_at(trace_ref.at[sp, b, wg], jnp.asarray(pos, jnp.int32))

        stamp(0)
        init_barriers(bar_wg)

        def load():  # by warpgroup 0; every warpgroup waits on idx_bar, then q_bar
            # the slots first, on their own barrier: the gathers start without waiting for q (27 KB raw at K3)
            plgpu.copy_gmem_to_smem(slots_ref.at[b, sp], idx_smem, idx_bar)
            plgpu.copy_gmem_to_smem(q_ref.at[b], qraw_smem if qk else q_smem, q_bar)  # raw q: [H·c/128, 128]
            if f8:
                plgpu.copy_gmem_to_smem(q_lo_ref.at[b], q_lo_smem, q_bar)
            if not qk:
                plgpu.copy_gmem_to_smem(c2_ref.at[b], c2_smem, q_bar)

        if NW > 1:
            pl.when(wg == 0)(load)
        else:
            load()

        plgpu.barrier_wait(idx_bar)
        translate(idx_smem, bt_ref.at[b], *wg_arg)  # this warpgroup's positions -> pool rows
        stamp(1)

        def bar(slot):  # a stage's mbarrier (8 bytes in an int32 scratch)
            return bar_wg.at[pl.ds(2 * slot, 2)]

        def block(i):  # the CTA's block row of this warpgroup's i-th block
            return wg + NW * i

        for s in range(min(S, nb_w)):
            issue(pool_ref, rows_wg.at[s], idx_smem.at[block(s)], bar(s))
        plgpu.barrier_wait(q_bar)
        if qk:  # while the first gathers are in flight (q is first read by the first block's logits)
            prep_q(qraw_smem, q_smem, c2_smem, sc_ref.at[pl.ds(0, 1)], *wg_arg)
        stamp(2)

        def step(i, carry):
            stats, out = carry
            slot = i % S
            wait(bar(slot), (i // S).astype(jnp.int32))
            stamp(3 + 2 * i)
            stage = rows_wg.at[slot]

            def logits(*accs):
                for jj, fn in enumerate(logits_a):
                    acc = accs[jj % len(accs)]
                    if not f8:
                        plgpu.wgmma(acc, fn(stage), q_smem.at[:, pl.ds(jj * LC, LC)].T)
                    else:
                        for g, a in enumerate(fn(stage)):  # the stored bytes times q's hi and lo planes
                            cols = pl.ds(jj * LC + 32 * g, 32)
                            plgpu.wgmma(acc, a, plgpu.transpose_ref(q_smem.at[:, cols], (1, 0)))
                            plgpu.wgmma(acc, a, plgpu.transpose_ref(q_lo_smem.at[:, cols], (1, 0)))
                    if chunk_wait:  # this chunk's A registers are free after it
                        plgpu.wgmma_wait(0)
                return functools.reduce(lambda x, y: x + y, [a[...] for a in accs])

            s_t = pl.run_scoped(logits, *[plgpu.ACC((KEYS, HEADS), jnp.float32) for _ in range(NA)])
            p, stats, out = softmax(s_t, stats, out, idx_smem.at[block(i)], red_wg.at[i % 2], c2_smem)
            if v8:  # P · 2^8 as e4m3 hi / lo planes, [heads, positions]
                store_p(p, p_wg.at[0], p_wg.at[1])
            else:
                p_wg[...] = p
            plgpu.commit_smem()

            def pv(acc):
                if v8:
                    for g, fn in enumerate(value_a):
                        a, cols = fn(stage), pl.ds(32 * g, 32)
                        plgpu.wgmma(acc, a, plgpu.transpose_ref(p_wg.at[0, :, cols], (1, 0)))
                        plgpu.wgmma(acc, a, plgpu.transpose_ref(p_wg.at[1, :, cols], (1, 0)))
                        if chunk_wait:
                            plgpu.wgmma_wait(0)
                    return
                for kk, fn in enumerate(value_a):
                    plgpu.wgmma(acc, fn(stage), p_wg.at[pl.ds(kk * VK, VK)])
                    if chunk_wait:
                        plgpu.wgmma_wait(0)

            out = pl.run_state(pv)(plgpu.ACC.init(out))
            stamp(4 + 2 * i)

            @pl.when(i + S < nb_w)
            def _refill():
                issue(pool_ref, stage, idx_smem.at[block(i + S)], bar(slot))

            return stats, out

        zeros = plgpu.layout_cast(jnp.zeros((R, HEADS), jnp.float32), wg_ty)
        stats, out = jax.lax.fori_loop(0, nb_w, step, (init_stats(), zeros))
        if NW == 1:
            finish(stats, out, red_wg.at[nb_w % 2], o_ref.at[sp, b], lse_ref.at[sp, b])
        else:  # each warpgroup's partial into its own stages, then an exact merge of the NW partials
            finish(stats, out, red_wg.at[nb_w % 2], rows_wg, lse_parts.at[wg])
            plgpu.barrier_arrive(done_bar)
            plgpu.barrier_wait(done_bar)
            combine(rows_smem, lse_parts, o_ref.at[sp, b], lse_ref.at[sp, b], *wg_arg)
        stamp(3 + 2 * nb_w)
        if last:  # the sequence's last split to get here merges them all
            last_merge(o_ref.at[:, b], lse_ref.at[:, b], cnt_ref.at[pl.ds(b, 1)], flag_smem, o_fin.at[b],
                       lse_fin.at[b], sc_ref.at[pl.ds(1, 1)], *wg_arg)
        stamp(4 + 2 * nb_w)


    out_type = (jax.ShapeDtypeStruct((NS, B, HEADS, R), jnp.float32), jax.ShapeDtypeStruct((NS, B, HEADS), jnp.float32))
    if last:  # + the merged result
        out_type += (jax.ShapeDtypeStruct((B, H, R), jnp.float32), jax.ShapeDtypeStruct((B, H), jnp.float32))
    if trace:
        out_type += (jax.ShapeDtypeStruct((NS, B, NW, 5 + 2 * nb_w), jnp.int32),)
    mesh = dict(grid=(NS, B), grid_names=("s", "b"))
    scratch = dict(
        q_smem=(plgpu.SMEM((HEADS, c), jnp.float8_e4m3fn, transforms=_q_fp8_transforms()) if f8 else
                plgpu.SMEM((HEADS, c), jnp.float16, **({"transforms": _q_transforms()} if qk else {}))),
        **({"q_lo_smem": plgpu.SMEM((HEADS, c), jnp.float8_e4m3fn, transforms=_q_fp8_transforms())} if f8 else {}),
        idx_smem=plgpu.SMEM((n_blk, KEYS), jnp.int32),
        c2_smem=plgpu.SMEM((HEADS,), jnp.float32),
        rows_smem=plgpu.SMEM(lead + (S, KEYS, stride), jnp.uint8),
        p_smem=(plgpu.SMEM(lead + (2, HEADS, KEYS), jnp.float8_e4m3fn, transforms=_q_fp8_transforms()) if v8 else
                plgpu.SMEM(lead + (KEYS, HEADS), jnp.float16)),
        red_smem=plgpu.SMEM(lead + (2, 4, HEADS), jnp.float32),
        bar_smem=plgpu.SMEM(lead + (2 * S,), jnp.int32),
        q_bar=plgpu.Barrier(num_arrivals=1 if qk else 3 if f8 else 2),
        idx_bar=plgpu.Barrier(num_arrivals=1),
        **(dict(lse_parts=plgpu.SMEM((NW, HEADS), jnp.float32), done_bar=plgpu.Barrier(num_arrivals=NW))
           if NW > 1 else {}),
        **(dict(flag_smem=plgpu.SMEM((1,), jnp.int32)) if last else {}),
        **(dict(qraw_smem=plgpu.SMEM((H * c // 128, 128), q.dtype)) if qk else {}),
    )
    thread_kw = dict(num_threads=NW, thread_name="wg") if NW > 1 else {}
    params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)
    if qk:  # rows of 128: TMA boxes are at most 256 wide
        if (H * c) % 128:
            raise ValueError(f"prep='kernel' needs H·c a multiple of 128, got {H}·{c}")
        q = q.reshape(B, H * c // 128, 128)
    args = (slots, jnp.asarray(block_tables, jnp.int32), q) + ((q_lo,) if f8 else ()) + (() if qk else (c2,)) + (
        pool_u8,)
    if qk or last:
        ls = jnp.asarray(layer_scale, jnp.float32)
        args += (jnp.stack([ls * (scale if qk else 1.0), ls]),)
    if not last:
        return plgpu.kernel(sparse_mla_mgpu, out_type=out_type, **mesh, **thread_kw, scratch_types=scratch,
                            compiler_params=params)(*args)
    # "last": the counters are a mutable ref aliased in and out, which `plgpu.kernel`'s vmap wrapper cannot take —
    # launch through `pl.kernel` on the same mesh, the scratch allocated as `plgpu.kernel` does
    counters = jax.new_ref(jnp.zeros((B,), jnp.int32))

    def body(*refs):
        pl.run_scoped(functools.partial(sparse_mla_mgpu, *refs), collective_axes=thread_kw.get("thread_name", ()),
                      **scratch)

    out = pl.kernel(body, out_type=out_type, mesh=plgpu.Mesh(**mesh, **thread_kw), compiler_params=params,
                    name="sparse_mla_mgpu")(*args, counters)
    return (out[2], out[3]) + tuple(out[4:])


@functools.partial(jax.jit, static_argnames=("fmt", "scale", "value_dim", "config"))
def decode(q_bhc, kv_parts, block_tables, idx_bk, *, fmt, scale: float, value_dim: int, layer_scale=1.0,
           config: MgpuSparseConfig = MgpuSparseConfig()):
    """`sparse_gpu_triton.decode`'s contract for fp8 rows at storage precision: q `[B, H, c]` (H ≤ 16), kv_parts the
    pool's one fp8 part `[num_blocks, page, c]`, block_tables `[B, max_blocks]`, idx `[B, k]` positions (−1 =
    empty) -> (o `[B, H, R]` f32, lse `[B, H]` f32). The splits' partials are merged in this kernel
    (`merge="last"`) or by `sparse_gpu_triton.merge_splits` (one launch; it also drops the padded heads and applies
    the layer scale)."""
    if not supports(fmt):
        raise ValueError(f"the mgpu sparse MLA kernel reads fp8 rows with R in (128, 256, 512), not {fmt}")
    R = fmt.latent
    if value_dim != R:
        raise ValueError(f"value_dim must be the latent width {R}, got {value_dim}")
    (pool,) = kv_parts
    nblocks, page, c = pool.shape
    B, H, _ = q_bhc.shape
    ls = jnp.asarray(layer_scale, jnp.float32)
    if config.prep == "kernel":
        q, c2 = (q_bhc if q_bhc.dtype in (jnp.float32, jnp.bfloat16) else q_bhc.astype(jnp.float32)), None
    elif config.logits_mma == "fp8":
        q_hi, q_lo, c2 = prepare_q_fp8(q_bhc, scale * ls)
        q = (q_hi, q_lo)
    else:
        q, c2 = prepare_q(q_bhc, scale * ls)
    slots = prepare_slots(idx_bk, config.splits, config.warpgroups)
    pool_u8 = jax.lax.bitcast_convert_type(pool, jnp.uint8).reshape(nblocks * page, c)
    o, lse = kernel_call(q, c2, slots, block_tables, pool_u8, R=R, page=page, config=config, H=H,
                         layer_scale=ls, scale=scale)
    if config.merge == "last":
        return o, lse
    return merge(o, lse, H, ls)


def merge(o, lse, H: int, layer_scale, interpret: bool = False):
    """Per-split (o `[NS, B, 16, R]`, lse `[NS, B, 16]`) -> (o `[B, H, R]` · layer scale, lse `[B, H]`)."""
    if o.shape[0] == 1:
        return o[0, :, :H] * layer_scale, lse[0, :, :H]
    return merge_splits(o, lse, layer_scale, H, interpret=interpret)
