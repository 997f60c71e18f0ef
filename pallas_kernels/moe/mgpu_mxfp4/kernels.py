"""The Mosaic GPU MXFP4 grouped-matmul kernels on the padded plan (Hopper, GPU only).

`kernel_call`: one warpgroup per CTA, `ctas_per_sm` CTAs per SM looping over work items (row tile, 64-column
block); the weights stream through a TMA pipeline, the decode writes the wgmma A operand in registers (weights
as the M side, 64 columns per warpgroup) and a tile of x rows is the N side. x planes `[2, m_pad, K/2]` bf16 and a
`PreparedWeight` -> out `[m_pad, N]` (fp32 or bf16).
`kernel_call_ws` / `kernel_call_gated_ws`: warp-specialised (W compute warpgroups of 64 columns each and one
memory warpgroup per CTA); `kernel_call_gated_ws` computes gate and up of each x tile and the activation in the
epilogue, writing h only. fp32 accumulation everywhere.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from .config import BLOCK, COLS, MgpuConfig, WS_MEMORY_REGISTERS, WS_WARPGROUPS, _PoolRegisterSplit, ws_stages
from .decode import _bf16_decode
from .layout import PreparedWeight


def _store_transposed_fn():
    """The inline Mosaic GPU body that writes a WGMMA-layout `[64, R]` fp32 accumulator transposed into a `[R, 64]`
    shared-memory tile of fp32 or a 16-bit float (rounded to nearest even): each thread stores its own registers'
    elements (R·64 scalar stores per item)."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, memref, vector
    from jax.experimental.mosaic.gpu import utils as mgu

    def fn(ctx, acc, o_ref):
        del ctx
        index = ir.IndexType.get()
        regs = acc.registers
        elt = ir.MemRefType(o_ref.type).element_type
        narrow = str(elt) != "f32"
        for (row, col), ri in zip(acc.layout.thread_idxs(acc.shape), np.ndindex(regs.shape)):
            reg = regs[ri]  # vector<2xf32>: columns col, col + 1 of row `row`
            for j in range(ir.VectorType(reg.type).shape[0]):
                v = vector.extract(reg, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([j]))
                memref.store(arith.truncf(elt, v) if narrow else v, o_ref, [arith.addi(col, mgu.c(j, index)), row])

    return fn


def _store_tile(acc, o_smem, out_ref, nb, t, store: str):
    """A work item's `[64, rows]` fp32 result -> out[rows·t …, 64·nb …] (`store="rows"`) through the `[rows, 64]`
    staging buffer (written transposed, `_store_transposed_fn`) and a TMA copy, once the previous item's copy has
    read the buffer. "planes": out is the next matmul's x planes `[2, m_pad, N/2]` and block nb of the
    (`planes_column_order`) columns goes to plane nb mod 2, columns 64·(nb // 2) … (the rows' tile as for "rows")."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    R = o_smem.shape[0]
    plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()))(_store_transposed_fn())(acc, o_smem)
    plgpu.commit_smem()
    if store == "rows":
        dst = out_ref.at[pl.ds(t * R, R), pl.ds(nb * COLS, COLS)]
    else:
        dst = out_ref.at[nb % 2, pl.ds(t * R, R), pl.ds(nb // 2 * COLS, COLS)]
    plgpu.copy_smem_to_gmem(o_smem, dst)


def _for_each_item(t_max: int, n_blocks: int, tile_group_ref, num_ref, item):
    """The CTAs' loop over work items (row tile t, 64-column block nb), column blocks innermost (the CTAs in flight
    share the x tile): `item(t, nb, g)` for each live tile, g its expert."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    @plgpu.nd_loop((t_max * n_blocks,), collective_axes="sm")
    def _item(info):
        (i,) = info.index
        t = i // n_blocks

        @pl.when(t < num_ref[0])
        def _live():
            item(t, i % n_blocks, tile_group_ref[t])


def _cta_grid(cfg: MgpuConfig) -> tuple[int]:
    """`ctas_per_sm` CTAs per SM of the default device (132 SMs, an H100/H200, when lowering without a GPU)."""
    num_sms = jax.devices()[0].core_count if jax.devices()[0].platform == "gpu" else 132
    return (num_sms * cfg.ctas_per_sm,)


def _launch(body, N: int, m_pad: int, cfg: MgpuConfig, out_dtype=jnp.float32):
    """`body` as a Mosaic GPU kernel: one warpgroup per CTA, `ctas_per_sm` CTAs per SM looping over the work items
    (`nd_loop` over the "sm" axis), out `[m_pad, N]` in `out_dtype` (fp32 or bf16) and a `[rows, 64]` staging
    buffer."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((m_pad, N), out_dtype),
        grid=_cta_grid(cfg),
        grid_names=("sm",),
        scratch_types=dict(o_smem=plgpu.SMEM((cfg.rows, COLS), out_dtype)),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )


def _decode_and_mma(decode, acc_refs, w_bufs, xs_s):
    """One pipeline step: for each (accumulator `[64, rows]`, codes `[64, kh]` and scales `[kh/16, 64]` in shared
    memory), the codes decoded (`decode`, `_bf16_decode`) and multiplied with the x planes' tile `xs_s [2, rows, kh]`
    (bf16), then a wait for those MMAs: the next decode reuses the A registers, and the step's buffers are released
    only after it (leaving one group in flight — wgmma_wait(1), x released a step late — gave wrong results and NaNs
    on the H200)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    for i, acc_ref in enumerate(acc_refs):
        lo, hi = decode(w_bufs[2 * i], w_bufs[2 * i + 1])
        plgpu.wgmma(acc_ref, lo, plgpu.transpose_ref(xs_s.at[0], (1, 0)))
        plgpu.wgmma(acc_ref, hi, plgpu.transpose_ref(xs_s.at[1], (1, 0)))
        plgpu.wgmma_wait(0)


def _mma_over_k(decode, acc_ref, codes_ref, scales_ref, xs_ref, nb, x_rows, x_index, cfg: MgpuConfig):
    """One tile's loop over K into the accumulator `acc_ref [64, rows]`: per step, the 64-column block nb of one
    expert's codes `[N, K/2]` and scales `[K/32, N]` decoded and multiplied with the x planes' tile (`BlockSpec` row
    dimension `x_rows` — a block size or `pl.Element` — at index `x_index`), through a TMA pipeline of `cfg.steps`
    stages."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    kh = cfg.kh

    def step(_, codes_s, scales_s, xs_s):
        _decode_and_mma(decode, (acc_ref,), (codes_s, scales_s), xs_s)

    plgpu.emit_pipeline(
        step,
        grid=(xs_ref.shape[-1] // kh,),
        in_specs=[plgpu.BlockSpec((COLS, kh), lambda kk: (nb, kk)),
                  plgpu.BlockSpec((kh // 16, COLS), lambda kk: (kk, nb)),
                  plgpu.BlockSpec((2, x_rows, kh), lambda kk: (0, x_index, kk))],
        max_concurrent_steps=cfg.steps,
    )(codes_ref, scales_ref, xs_ref)


def kernel_call(xs, tile_group, num_tiles, w: PreparedWeight, config: MgpuConfig = MgpuConfig(),
                out_dtype=jnp.float32, *, scale=None):
    """The Mosaic GPU kernel alone: `prepare_rows`' outputs and the weight -> out `[m_pad, N]` in `out_dtype`, fp32 or
    bf16 (fp32 accumulation either way; rows of dead tiles unwritten); warpgroups > 1: `kernel_call_ws`.

    `scale` `[E]` fp32: each expert's output factor (the placed layout's `out_scale`, `expert_scale`), applied to
    the fp32 accumulator before the store, so no XLA pass over the output is needed for it."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    if config.warpgroups > 1:
        return kernel_call_ws(xs, tile_group, num_tiles, w, config, out_dtype, scale=scale)
    cfg = config
    R, kh = cfg.rows, cfg.kh
    t_max = tile_group.shape[0]
    m_pad = t_max * R
    _check_kernel_shapes(xs, w, cfg, tile_group)
    n_blocks = w.out_features // COLS
    decode = _bf16_decode(kh, w.layout)
    extra = () if scale is None else (scale,)

    def body(tile_group_ref, num_ref, *refs, o_smem):
        extra_refs, (xs_ref, codes_ref, scales_ref, out_ref) = refs[:len(extra)], refs[len(extra):]

        def item(t, nb, g):
            def acc_scope(acc_ref):
                _mma_over_k(decode, acc_ref, codes_ref.at[g], scales_ref.at[g], xs_ref, nb, R, t, cfg)
                return acc_ref[...]

            acc = pl.run_scoped(acc_scope, plgpu.ACC((COLS, R), jnp.float32))
            if extra_refs:
                acc = acc * extra_refs[0][g]
            _store_tile(acc, o_smem, out_ref, nb, t, "rows")

        _for_each_item(t_max, n_blocks, tile_group_ref, num_ref, item)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return _launch(body, w.out_features, m_pad, cfg, out_dtype)(tile_group, num_tiles, *extra, xs, w.codes,
                                                               w.scales_t)


def _check_kernel_shapes(xs, w: PreparedWeight, cfg: MgpuConfig, tile_group):
    """x planes `[2, m_pad, K/2]` and weight `[E, N, K/2]` as the padded-plan kernels take them, m_pad = t_max · rows
    for `tile_group [t_max]`."""
    _, x_rows, KH = xs.shape
    KH2, N = w.codes.shape[2], w.out_features
    m_pad = tile_group.shape[0] * cfg.rows
    if KH2 != KH or KH % cfg.kh or cfg.kh % BLOCK or N % COLS or x_rows != m_pad:
        raise ValueError(f"mgpu MXFP4: packed K/2={KH2} (x: {KH}) must be a multiple of kh={cfg.kh} (a multiple of "
                         f"{BLOCK}), N={N} of {COLS}; x rows {x_rows} for {tile_group.shape[0]} tiles of {cfg.rows}")


def kernel_call_ws(xs, tile_group, num_tiles, w: PreparedWeight, config: MgpuConfig, out_dtype=jnp.float32, *,
                   scale=None):
    """The padded-plan kernel, warp-specialised (`MgpuConfig(warpgroups=2)`): the same operands and result as
    `kernel_call` (out `[m_pad, N]` in `out_dtype`, rows of dead tiles unwritten).

    One CTA per SM (W + 1 warpgroups take the register file: W compute warpgroups at (512 − 40) / W registers, the
    memory warpgroup at 40). A work item is (row tile t, block of C = 64·W columns); its K loop is one
    `emit_pipeline_warp_specialized` whose memory warpgroup copies each step's codes `[C, kh]`, scales
    `[kh/16, C]` and x planes `[2, R, kh]`; compute warpgroup w decodes columns 64w … 64w + 63 of the step into
    its wgmma A registers and multiplies them with the shared x tile, waiting for its own MMAs before the next
    decode (the registers are reused). The CTA's items form one chain of pipelines (`pipeline_state` START /
    STEADY / STOP), so the memory warpgroup fetches the next item's first steps while the last ones compute; the
    chain needs the K loop's steps to be a whole number of rounds of the stages (`ws_stages`). `scale`: as in
    `kernel_call`."""

    def epilogue(accs, g, *scale_ref):
        return accs[0] * scale_ref[0][g] if scale_ref else accs[0]

    return _ws_call(xs, tile_group, num_tiles, (w,), config, out_dtype, epilogue, () if scale is None else (scale,))


def kernel_call_gated_ws(xs, tile_group, num_tiles, w_gate: PreparedWeight, w_up: PreparedWeight, activation,
                         config: MgpuConfig, gate_scale=None, up_scale=None, out_dtype=jnp.float32):
    """Gate and up in one warp-specialised kernel (`MgpuConfig(gate_up="fused")`, warpgroups ≥ 2): `prepare_rows`'
    x planes, two weights of one shape, layout and output order -> h `[m_pad, F]` `out_dtype` (fp32 or bf16, rounded
    to nearest even) = activation(x·Wgᵀ·sg, x·Wuᵀ·su) per padded row of a live tile (weights with
    out_order="planes": the down matmul's x planes `[2, m_pad, F/2]`), with `gate_scale` / `up_scale` `[E]` each
    expert's fp32 output factor (the placed layout's `out_scale`) or None. As `kernel_call_ws`, with each step's
    stage holding both weights' blocks beside the one x tile and each compute warpgroup two accumulators (gate, up)
    for its 64 columns; `activation(g, u)` runs on them in the epilogue (it must lower in Mosaic GPU: elementwise
    arithmetic, tanh, logistic, exp), so gate and up are never written to memory."""
    def epilogue(accs, g, *scale_refs):
        gate, up = accs
        if scale_refs:
            gate, up = gate * scale_refs[0][g], up * scale_refs[1][g]
        return activation(gate, up)

    scales = () if gate_scale is None else (gate_scale, up_scale)
    return _ws_call(xs, tile_group, num_tiles, (w_gate, w_up), config, out_dtype, epilogue, scales)


def _ws_call(xs, tile_group, num_tiles, weights: tuple, config: MgpuConfig, out_dtype, epilogue, extra):
    """The warp-specialised kernel over one weight or a (gate, up) pair of one shape and layout: each work item's
    accumulators `[64, R]` fp32 (one per weight) -> `epilogue(accs, g, *extra_refs)` (g the item's expert, `extra`
    kernel inputs such as per-expert scales) -> out rows `[R, 64]` of its tile and column block."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax import lax
    from jax._src.pallas.mosaic_gpu.pipeline import PipelinePipeline

    if config.mma != "bf16" or config.warpgroups not in WS_WARPGROUPS:
        raise ValueError(f"mgpu MXFP4: the warp-specialised kernel decodes to bf16 on one of {WS_WARPGROUPS} compute "
                         f"warpgroups; got mma={config.mma!r}, warpgroups={config.warpgroups}")
    w = weights[0]
    _check_same_form(weights)
    # a fused gate / up pair whose columns are in the down matmul's plane order writes those planes
    planes = len(weights) == 2 and w.out_order == "planes"
    _check_kernel_shapes(xs, w, config, tile_group)
    KH = xs.shape[2]
    R, kh, N = config.rows, config.kh, w.out_features
    m_pad = tile_group.shape[0] * R
    wgs, n_w = config.warpgroups, len(weights)
    cols = COLS * wgs
    # work items per row tile; when N is not whole items, the last one's columns past N are read as zeros (TMA
    # fills what lies outside the weight) and its warpgroups past N store nothing
    blocks = -(-N // cols)
    ragged = N % cols != 0
    steps = KH // kh
    out_bytes = wgs * R * COLS * jnp.dtype(out_dtype).itemsize  # the compute warpgroups' staging tiles
    stages = ws_stages(steps, config.steps, stage_bytes=n_w * (cols * kh + kh // 16 * cols) + 2 * R * kh * 2,
                       fixed_bytes=out_bytes + 1024)  # + barriers
    decode = _bf16_decode(kh, w.layout)
    num_sms = _cta_grid(dataclasses.replace(config, ctas_per_sm=1))[0]

    def kernel(tile_group_ref, num_ref, *refs, o_smem):
        extra_refs, (xs_ref, *w_refs, out_ref) = refs[:len(extra)], refs[len(extra):]
        wg = lax.axis_index("wg")
        my_cols = pl.ds(wg * COLS, COLS)

        def mma_step(_, *bufs):
            *w_bufs, xs_s, acc_refs = bufs
            mine = [b.at[my_cols] if j % 2 == 0 else b.at[:, my_cols] for j, b in enumerate(w_bufs)]
            _decode_and_mma(decode, acc_refs, mine, xs_s)
            return acc_refs

        def pipeline(body, compute_context, state):
            weight_specs = [plgpu.BlockSpec((cols, kh), lambda kk: (0, kk)),
                            plgpu.BlockSpec((kh // 16, cols), lambda kk: (kk, 0))]
            return plgpu.emit_pipeline_warp_specialized(
                body, grid=(steps,), memory_registers=WS_MEMORY_REGISTERS, wg_axis="wg",
                num_compute_wgs=wgs, max_concurrent_steps=stages, compute_context=compute_context,
                pipeline_state=state,
                in_specs=weight_specs * n_w + [plgpu.BlockSpec((2, R, kh), lambda kk: (0, 0, kk))])

        def operands(t, nb):
            g = tile_group_ref[t]
            per_weight = [(codes.at[g, pl.ds(nb * cols, cols)], scales.at[g, :, pl.ds(nb * cols, cols)])
                          for codes, scales in zip(w_refs[0::2], w_refs[1::2])]
            return (*[r for pair in per_weight for r in pair], xs_ref.at[:, pl.ds(t * R, R)])

        ignore = lambda *_, **__: None  # noqa: E731 — the allocations depend on the specs and shapes only

        @functools.partial(pl.run_scoped, allocs=pipeline(ignore, ignore, None).get_allocations(*operands(0, 0)),
                           collective_axes="wg")
        def _scope(allocs):
            @plgpu.nd_loop((num_ref[0] * blocks,), collective_axes="sm")
            def _item(info):
                (i,) = info.index
                t, nb = i // blocks, i % blocks

                def compute_context(eval_pipeline):
                    def acc_scope(*acc_refs):
                        eval_pipeline(acc_refs)
                        return tuple(a[...] for a in acc_refs)

                    accs = pl.run_scoped(acc_scope, *[plgpu.ACC((COLS, R), jnp.float32)] * n_w)
                    g = tile_group_ref[t]
                    out = epilogue(accs, g, *extra_refs)
                    block = nb * wgs + wg  # this warpgroup's 64-column block of the output

                    def store():
                        _store_tile(out, o_smem.at[wg], out_ref, block, t, "planes" if planes else "rows")

                    if ragged:
                        pl.when(block < N // COLS)(store)
                    else:
                        store()

                first, last = info.local_index == 0, info.local_index == info.num_local_steps - 1
                state = jnp.where(first, int(PipelinePipeline.START),
                                  jnp.where(last, int(PipelinePipeline.STOP), int(PipelinePipeline.STEADY)))

                @pl.when(first & last)  # the CTA's only item: a pipeline of its own
                def _alone():
                    pipeline(mma_step, compute_context, None)(*operands(t, nb), allocations=allocs)

                @pl.when(jnp.logical_not(first & last))
                def _chained():
                    pipeline(mma_step, compute_context, state)(*operands(t, nb), allocations=allocs)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    w_operands = [a for v in weights for a in (v.codes, v.scales_t)]
    with _PoolRegisterSplit():  # the pipeline's setmaxnreg is emitted while the kernel is traced, here
        return plgpu.kernel(
            kernel,
            out_type=jax.ShapeDtypeStruct((2, m_pad, N // 2) if planes else (m_pad, N), out_dtype),
            grid=(num_sms,),
            grid_names=("sm",),
            num_threads=wgs + 1,
            thread_name="wg",
            scratch_types=dict(o_smem=plgpu.SMEM((wgs, R, COLS), out_dtype)),
            compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        )(tile_group, num_tiles, *extra, xs, *w_operands)


def _check_same_form(weights) -> None:
    """Fused gate / up read one x tile for both weights and write one h: they need one shape, layout and output
    order."""
    forms = [(v.codes.shape, v.layout, v.out_order) for v in weights]
    if any(f != forms[0] for f in forms):
        raise ValueError(f"mgpu MXFP4: fused gate / up need one shape, layout and output order, got {forms}")
