"""Probe: the sparse-MLA Mosaic kernel's gather alone — the same slots, block-table translation, per-row bulk copies
(`cp.async.bulk`, one per 576-byte row, 64 rows per mbarrier stage) and the same grid (splits × sequences,
warpgroups per CTA), with no arithmetic. How close to copy bandwidth can this gather structure get?

    python3 bench/mla_gather_probe.py [--configs '[{}, {"splits": 8, "warpgroups": 1, "stages": 4}]']

Why (issue #5): the whole op runs at 0.26 of copy against a 0.60 bar; removing a quarter of its
instructions (the fp8 tensor-core products) moved the kernel by 4%, so it is not issue-bound. If the gather alone
is also far from the bar, the next step is the gather's structure (more bytes in flight per SM, fewer / larger
copies), not the arithmetic. Prints µs and latent bytes/s vs the torch copy bandwidth measured in the same run.
GPU only; `--lower-only` lowers the kernels for CUDA on any machine (a CPU check of this file).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _timing import device_seconds, torch_copy_bandwidth  # noqa: E402

from pallas_kernels.mla import sparse_mgpu as sm  # noqa: E402

PAGE, R, ROPE, TOPK = 64, 512, 64, 2048
C = R + ROPE


def gather_only(slots, block_tables, pool_u8, *, page: int, stages: int, warpgroups: int, issue_with: str = "tma"):
    """slots `[B, NS, n_blk, 64]` (`sm.prepare_slots`), block tables `[B, max_blocks]`, pool rows `[N, c]` u8 ->
    `[NS, B, 16]` f32 (unwritten: the kernel only gathers; the output exists because a kernel must have one)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    B, NS, n_blk, keys = slots.shape
    S, NW = stages, warpgroups
    c = pool_u8.shape[1]
    stride = sm.row_stride(c)
    nb_w = n_blk // NW
    max_blocks, nblocks = block_tables.shape[1], pool_u8.shape[0] // page
    ref, splat = plgpu.RefType(), plgpu.Layout.WG_SPLAT
    init_barriers = plgpu.inline_mgpu(arg_types=(ref,))(sm._init_barriers_fn(S))
    translate = plgpu.inline_mgpu(arg_types=(ref, ref) + ((splat,) if NW > 1 else ()))(
        sm._translate_fn(nb_w, NW, page, nblocks, max_blocks))
    issue = plgpu.inline_mgpu(arg_types=(ref,) * 4)(sm.issue_fn(issue_with)(c, stride))
    wait = plgpu.inline_mgpu(arg_types=(ref, splat))(sm._wait_fn())
    lead = (NW,) if NW > 1 else ()

    def body(slots_ref, bt_ref, pool_ref, out_ref, idx_smem, rows_smem, bar_smem, idx_bar):
        del out_ref
        sp, b = jax.lax.axis_index("s"), jax.lax.axis_index("b")
        wg = jax.lax.axis_index("wg") if NW > 1 else 0
        wg_arg = (wg.astype(jnp.int32),) if NW > 1 else ()
        mine = (lambda r: r.at[wg]) if NW > 1 else (lambda r: r)  # noqa: E731
        rows_wg, bar_wg = mine(rows_smem), mine(bar_smem)
        init_barriers(bar_wg)

        def load():
            plgpu.copy_gmem_to_smem(slots_ref.at[b, sp], idx_smem, idx_bar)

        if NW > 1:
            pl.when(wg == 0)(load)
        else:
            load()
        plgpu.barrier_wait(idx_bar)
        translate(idx_smem, bt_ref.at[b], *wg_arg)

        def bar(slot):
            return bar_wg.at[pl.ds(2 * slot, 2)]

        for s in range(min(S, nb_w)):
            issue(pool_ref, rows_wg.at[s], idx_smem.at[wg + NW * s], bar(s))

        def step(i, carry):
            slot = i % S
            wait(bar(slot), (i // S).astype(jnp.int32))

            @pl.when(i + S < nb_w)
            def _refill():
                issue(pool_ref, rows_wg.at[slot], idx_smem.at[wg + NW * (i + S)], bar(slot))

            return carry

        jax.lax.fori_loop(0, nb_w, step, 0)

    scratch = dict(idx_smem=plgpu.SMEM((n_blk, keys), jnp.int32),
                   rows_smem=plgpu.SMEM(lead + (S, keys, stride), jnp.uint8),
                   bar_smem=plgpu.SMEM(lead + (2 * S,), jnp.int32),
                   idx_bar=plgpu.Barrier(num_arrivals=1))
    thread_kw = dict(num_threads=NW, thread_name="wg") if NW > 1 else {}
    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((NS, B, 16), jnp.float32), grid=(NS, B),
                        grid_names=("s", "b"), **thread_kw, scratch_types=scratch,
                        compiler_params=plgpu.CompilerParams(
                            lowering_semantics=plgpu.LoweringSemantics.Warpgroup))(slots, block_tables, pool_u8)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs",
                    default='[{}, {"warpgroups": 4, "stages": 1}, {"issue": "lsu"}, {"issue": "lsu", "warpgroups": 4, '
                            '"stages": 1}]',
                    help="JSON list of overrides of splits / warpgroups / stages / issue (tma: one bulk copy per "
                         "row, as the kernel; lsu: 16-byte cp.async chunks) of the sparse kernel's default")
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--chain", type=int, default=3, help="distinct selections per timing chain (out of L2)")
    ap.add_argument("--lower-only", action="store_true", help="lower every config for CUDA and stop (any machine)")
    args = ap.parse_args()
    B, ctx = args.batch, args.ctx
    nb = B * (ctx // PAGE) + 1
    base = sm.MgpuSparseConfig()
    configs = [dict(dict(splits=base.splits, warpgroups=base.warpgroups, stages=base.stages, issue="tma"), **o)
               for o in json.loads(args.configs)]
    if args.lower_only:
        for cfg in configs:
            slots = jax.ShapeDtypeStruct((B, cfg["splits"], TOPK // (cfg["splits"] * 64), 64), jnp.int32)
            f = jax.jit(lambda s, bt, p, cfg=cfg: gather_only(s, bt, p, page=PAGE, stages=cfg["stages"],
                                                               warpgroups=cfg["warpgroups"], issue_with=cfg["issue"]))
            text = f.trace(slots, jax.ShapeDtypeStruct((B, ctx // PAGE), jnp.int32),
                           jax.ShapeDtypeStruct((nb * PAGE, C), jnp.uint8)).lower(
                lowering_platforms=("cuda",)).as_text()
            print(f"{cfg}: lowers ({'mosaic_gpu' in text})")
        return
    bw = torch_copy_bandwidth()
    print(f"jax {jax.__version__} {jax.devices()[0].device_kind}; copy {bw / 1e12:.2f} TB/s", flush=True)
    key = jax.random.PRNGKey(0)
    pool_u8 = jax.random.bits(key, (nb * PAGE, C), jnp.uint8)
    bt = jax.random.permutation(jax.random.fold_in(key, 1), jnp.arange(1, nb, dtype=jnp.int32)).reshape(B, -1)
    rng = np.random.default_rng(ctx)
    sel = jnp.asarray(np.stack([np.stack([np.sort(rng.choice(ctx, TOPK, replace=False)) for _ in range(B)])
                                for _ in range(args.chain)]), jnp.int32)
    lat_bytes = B * TOPK * C
    for cfg in configs:
        slots = jax.jit(jax.vmap(lambda idx, cfg=cfg: sm.prepare_slots(idx, cfg["splits"], cfg["warpgroups"])))(sel)
        # the pool as an argument: closed over, jit would embed it in the program as a constant
        f = jax.jit(lambda s, bt, pool, cfg=cfg: gather_only(s, bt, pool, page=PAGE, stages=cfg["stages"],
                                                              warpgroups=cfg["warpgroups"],
                                                              issue_with=cfg["issue"])[..., :1])
        try:
            t = device_seconds(f, slots, bt, pool_u8, stacked=(0,))[0]
        except Exception as e:  # noqa: BLE001 — one failing config must not stop the others
            print(f"{cfg}: ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        print(f"gather only {json.dumps(cfg, separators=(',', ':')):44s} ctx={ctx} B={B}  {t * 1e6:7.1f} us  "
              f"{lat_bytes / t / 1e12:5.2f} TB/s  {lat_bytes / t / bw:5.3f} of copy", flush=True)


if __name__ == "__main__":
    main()
