#!/usr/bin/env python3
"""MoE bench (BENCHMARKS.md): grouped matmul at Kimi K3 shapes and MXFP4 decode, on one GPU; expert parallel on two.

    python3 bench/moe.py [--sweep] [--budget SECONDS] [--no-ep]

1. bf16 grouped matmul, 112 local experts, 16384 routed rows (random group sizes), 3584 -> 3072: ours (native
   Triton through jax-triton, `pallas_kernels.moe.gpu_triton`) vs a dense matmul of the same FLOPs (bar ≥ 0.9×) in
   two forms — one [M, K] x [K, N] matmul (reads one expert's weight) and a batched matmul of E even groups (reads
   all E weights, as a grouped matmul must) — and for reference torch._grouped_mm, XLA ragged_dot, JAX's bundled
   Mosaic GPU ragged_dot_mgpu (`pallas_kernels.moe.mgpu_ragged`).
2. MXFP4 weights (packed [E, N, K/2] + E8M0 [E, N, K/32], decoded in the kernel) at decode-sized groups (8 rows per
   expert; 32 and 64 for information): weight bytes read per second vs the measured copy bandwidth (bytes read +
   written per second of a device-to-device copy) — bar ≥ 70%.
3. The MXFP4 expert FFN (gate, up, down) on the Mosaic kernel: the tile layout (rows padded once for the three
   matmuls, `mgpu_mxfp4.expert_ffn_tiled`) against padding around each matmul and against the Triton kernel on the
   checkpoint's layout; one tile-layout matmul's weight bytes/s vs copy (bar ≥ 70%) and the whole FFN's
   (`--ffn-rows 8,32,146`: 146 rows per expert is a 16K-token prefill's load).
4. With ≥ 2 GPUs: expert-parallel FFN over a 2-device "model" axis (ragged_all_to_all and all-gather methods) vs the
   one-device result, and timings; the determinism check (same input twice -> same bits).

Every kernel's output is checked against XLA's ragged_dot in the same run before it is timed. The table
`name, shape, ours, peer, ratio, bar, pass/fail` comes last; JSON goes to $OUT/moe.json when OUT is set.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")  # leave room for the torch peers
if "--smoke" in sys.argv:  # the kernels in Triton's interpreter, which must be on before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from _timing import pipelined_seconds, torch_event_seconds  # noqa: E402
from pallas_kernels.moe import gpu_triton as moe_gpu  # noqa: E402
from pallas_kernels.moe import mgpu_ragged  # noqa: E402
from pallas_kernels.moe import mgpu_mxfp4 as mgpu_mx  # noqa: E402
from pallas_kernels.experimental import mxfp4_fp8_mma as fp8_mma  # noqa: E402
from pallas_kernels.moe import mxfp4 as mx  # noqa: E402
from pallas_kernels.moe import ops  # noqa: E402

E, M, K, N = 112, 16384, 3584, 3072
KW = {"backend": "gpu"}  # --smoke: the same code paths through Triton's interpreter on CPU, tiny shapes
ROWS: list[dict] = []
INFO: dict = {"notes": []}
T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def situ(g, u):  # docs/model.md §7 (K3)
    return 4.0 * jnp.tanh(g / 4.0) * jax.nn.sigmoid(g) * (25.0 * jnp.tanh(u / 25.0))


def row(name, shape, ours, peer, bar, unit, higher_is_better=True, info=False):
    ratio = (ours / peer) if (ours and peer) else None
    ok = None if (info or ratio is None or bar is None) else (ratio >= bar)
    ROWS.append(dict(name=name, shape=shape, ours=ours, peer=peer, ratio=ratio, bar=bar, unit=unit,
                     result=("info" if info else ("n/a" if ok is None else ("pass" if ok else "FAIL")))))


def time_jax(f, *args, reps=10, outer=5):
    jax.block_until_ready(f(*args))
    return pipelined_seconds(f, *args, reps=reps, rounds=outer)


def time_torch(f, reps=10, outer=5):
    return torch_event_seconds(lambda _: f(), calls=reps, rounds=outer)


def rel_err(a, b):
    a = np.asarray(jnp.asarray(a, jnp.float32))
    b = np.asarray(jnp.asarray(b, jnp.float32))
    return float(np.abs(a - b).max() / (np.abs(b).max() + 1e-30))


def random_sizes(key, m, e):
    """Random group sizes summing to m: e − 1 uniform cut points (as JAX's ragged_dot_mgpu example)."""
    cuts = jnp.sort(jax.random.randint(key, (e - 1,), 0, m + 1))
    bounds = jnp.concatenate([jnp.zeros(1, cuts.dtype), cuts, jnp.full((1,), m, cuts.dtype)])
    return jnp.diff(bounds).astype(jnp.int32)


def attempt(label, fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 — one failing candidate must not stop the run
        msg = f"{label}: {type(e).__name__}: {str(e)[:400]}"
        log("FAILED", msg)
        INFO["notes"].append(msg)
        if os.environ.get("BENCH_TRACEBACK"):
            traceback.print_exc()
        return None


def left(budget):
    return budget - (time.time() - T0)


# ------------------------------------------------------------------------------------------------ copy bandwidth

def copy_bandwidth():
    import torch

    n = 1 << 30  # 2 GiB of bf16
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    t = time_torch(lambda: dst.copy_(src), reps=10, outer=5)
    bw_torch = 2 * src.numel() * 2 / t
    xs = jax.random.normal(jax.random.key(9), (n,), jnp.bfloat16)
    t_j = time_jax(jax.jit(lambda a: a[::-1]), xs, reps=10, outer=3)
    bw_jax = 2 * n * 2 / t_j
    del src, dst, xs
    log(f"copy bandwidth: torch copy_ {bw_torch / 1e12:.2f} TB/s, XLA reverse-copy {bw_jax / 1e12:.2f} TB/s "
        "(bytes read + written)")
    INFO["copy_TBps_torch"], INFO["copy_TBps_xla"] = bw_torch / 1e12, bw_jax / 1e12
    return max(bw_torch, bw_jax)


# ------------------------------------------------------------------------------------------------- bf16 section

GPU_SWEEP = [  # 64x256 (w4/w8), 128x128 (w4), 64x128x128 were also timed on the H200: all slower
    moe_gpu.GpuConfig(bm=128, bn=256, bk=64, num_warps=8, num_stages=3),
    # a group's last tile runs a 64-row MMA when it holds ≤ 64 rows (1.46x -> 1.23x the rows computed)
    moe_gpu.GpuConfig(bm=128, bn=256, bk=64, num_warps=8, num_stages=3, bm_small=64),
    moe_gpu.GpuConfig(bm=128, bn=256, bk=64, num_warps=8, num_stages=4),
    moe_gpu.GpuConfig(bm=128, bn=256, bk=128, num_warps=8, num_stages=2),
    moe_gpu.GpuConfig(bm=128, bn=128, bk=64, num_warps=8, num_stages=4),
    # untimed: one row tile per expert at ~146 rows (128-row tiles cut most experts in two, and each row
    # tile streams the expert's whole weight again); ptxas 178 registers, 147 KB shared, wgmma, no spills
    moe_gpu.GpuConfig(bm=256, bn=128, bk=64, num_warps=8, num_stages=3),
    moe_gpu.GpuConfig(bm=256, bn=128, bk=64, num_warps=8, num_stages=4),  # 196 KB shared
]
MGPU_SWEEP = [  # run 1: (128,128,64,4,2) best of (128,128,64,4,1), (64,128,64,4,1), (128,256,64,3,1) too
    mgpu_ragged.MgpuConfig(128, 128, 64, 4, 2),
    mgpu_ragged.MgpuConfig(128, 128, 64, 4, 1),
]


def bench_bf16(args):
    key = jax.random.key(0)
    kx, kw, ks, _ = jax.random.split(key, 4)
    x = jax.random.normal(kx, (M, K), jnp.bfloat16)
    w = (jax.random.normal(kw, (E, K, N), jnp.float32) * K ** -0.5).astype(jnp.bfloat16)
    sizes = random_sizes(ks, M, E)
    s = np.asarray(sizes)
    INFO["k3_group_sizes"] = dict(min=int(s.min()), max=int(s.max()), mean=float(s.mean()), zeros=int((s == 0).sum()))
    flops = 2.0 * M * K * N
    shape = f"E={E} M={M} {K}->{N} bf16"
    tiles = {bm: int(np.sum(-(-s // bm))) for bm in (64, 128, 256)}
    INFO["k3_row_tiles"] = {f"bm={bm}": f"{t} tiles = {t * bm / M:.2f}x the rows" for bm, t in tiles.items()}
    log("group sizes", INFO["k3_group_sizes"], "tiles", INFO["k3_row_tiles"])

    ref = jax.jit(lambda a, b, g: jax.lax.ragged_dot(a, b, g, preferred_element_type=jnp.float32))(x, w, sizes)
    jax.block_until_ready(ref)

    # dense peer: same FLOPs, one weight matrix
    w0 = w[0]
    t_dense = time_jax(jax.jit(lambda a, b: jnp.dot(a, b)), x, w0)
    log(f"dense XLA {flops / t_dense / 1e12:.0f} TFLOP/s ({t_dense * 1e3:.3f} ms)")
    INFO["dense_xla_ms"] = t_dense * 1e3

    # dense peer with the grouped matmul's weight bytes: the same rows split evenly over the E experts, one batched
    # matmul [E, M/E, K] x [E, K, N] (cuBLAS batched GEMM). The single matmul above reads one 22 MB weight; a grouped
    # matmul must read all E weights (2.47 GB), which caps it below the single matmul whatever its kernel.
    me = M // E
    xb = x[: E * me].reshape(E, me, K)
    flops_b = 2.0 * E * me * K * N
    t_batched = time_jax(jax.jit(lambda a, b: jnp.einsum("emk,ekn->emn", a, b)), xb, w)
    log(f"dense batched XLA (E={E} x {me} rows) {flops_b / t_batched / 1e12:.0f} TFLOP/s ({t_batched * 1e3:.3f} ms)")
    INFO["dense_batched_xla_ms"] = t_batched * 1e3
    del xb

    # ours, swept
    best = (None, None)
    configs = GPU_SWEEP if args.sweep else GPU_SWEEP[:2]
    for cfg in configs:
        if left(args.budget) < 60:
            INFO["notes"].append("budget: bf16 sweep cut short")
            break
        f = jax.jit(lambda a, b, g, cfg=cfg: ops.grouped_matmul(a, b, g, **KW, out_dtype=jnp.bfloat16,
                                                                config=cfg))

        def run(f=f, cfg=cfg):
            err = rel_err(f(x, w, sizes), ref)
            if err > 2e-2:
                raise AssertionError(f"wrong result, rel err {err:.3g}")
            t = time_jax(f, x, w, sizes)
            log(f"ours {cfg}: {flops / t / 1e12:.0f} TFLOP/s ({t * 1e3:.3f} ms), err {err:.2e}")
            return t
        t = attempt(f"ours {cfg}", run)
        INFO.setdefault("ours_sweep_ms", {})[str(cfg)] = None if t is None else t * 1e3
        if t is not None and (best[0] is None or t < best[0]):
            best = (t, cfg)
    t_ours, cfg_best = best
    INFO["ours_best_config"] = str(cfg_best)
    row("grouped_matmul bf16 vs dense (one weight)", shape, t_ours and flops / t_ours / 1e12, flops / t_dense / 1e12,
        0.9, "TFLOP/s")
    row("grouped_matmul bf16 vs dense batched (same FLOPs and weight bytes)", shape, t_ours and flops / t_ours / 1e12,
        flops_b / t_batched / 1e12, 0.9, "TFLOP/s")

    # torch._grouped_mm
    def torch_peer():
        import torch

        xt = torch.from_dlpack(x)
        wt = torch.from_dlpack(w)
        offs = torch.from_dlpack(jnp.cumsum(sizes).astype(jnp.int32))
        try:
            f = lambda: torch._grouped_mm(xt, wt, offs=offs, out_dtype=torch.bfloat16)  # noqa: E731
            out = f()
        except Exception:  # noqa: BLE001 — it may want the [G, N, K] storage, transposed
            wnk = wt.transpose(-2, -1).contiguous()
            f = lambda: torch._grouped_mm(xt, wnk.transpose(-2, -1), offs=offs, out_dtype=torch.bfloat16)  # noqa
            out = f()
        err = rel_err(jnp.asarray(np.asarray(out.float().cpu())), ref)
        if err > 2e-2:
            raise AssertionError(f"torch._grouped_mm disagrees with ragged_dot: {err:.3g}")
        t = time_torch(f)
        log(f"torch._grouped_mm {flops / t / 1e12:.0f} TFLOP/s ({t * 1e3:.3f} ms)")
        return t
    t_torch = attempt("torch._grouped_mm", torch_peer)
    row("grouped_matmul bf16 vs torch._grouped_mm", shape, t_ours and flops / t_ours / 1e12,
        t_torch and flops / t_torch / 1e12, 1.0, "TFLOP/s", info=True)

    # XLA ragged_dot
    def xla_peer():
        f = jax.jit(lambda a, b, g: jax.lax.ragged_dot(a, b, g))
        t = time_jax(f, x, w, sizes, reps=2, outer=2)
        log(f"XLA ragged_dot {flops / t / 1e12:.1f} TFLOP/s ({t * 1e3:.1f} ms)")
        return t
    t_xla = attempt("XLA ragged_dot", xla_peer)
    row("grouped_matmul bf16 vs XLA ragged_dot", shape, t_ours and flops / t_ours / 1e12,
        t_xla and flops / t_xla / 1e12, None, "TFLOP/s", info=True)

    # JAX's bundled Mosaic GPU kernel
    t_mgpu = None
    for mc in (MGPU_SWEEP if args.sweep else MGPU_SWEEP[:2]):
        if left(args.budget) < 50:
            break

        def mg(mc=mc):
            f = jax.jit(lambda a, b, g: mgpu_ragged.mgpu_grouped_matmul(a, b, g, out_dtype=jnp.bfloat16, config=mc))
            err = rel_err(f(x, w, sizes), ref)
            if err > 2e-2:
                raise AssertionError(f"wrong result, rel err {err:.3g}")
            t = time_jax(f, x, w, sizes)
            log(f"ragged_dot_mgpu {mc}: {flops / t / 1e12:.0f} TFLOP/s ({t * 1e3:.3f} ms)")
            return t
        t = attempt(f"ragged_dot_mgpu {mc}", mg)
        if t is not None and (t_mgpu is None or t < t_mgpu):
            t_mgpu = t
    row("grouped_matmul bf16 vs ragged_dot_mgpu (best)", shape, t_ours and flops / t_ours / 1e12,
        t_mgpu and flops / t_mgpu / 1e12, 1.0, "TFLOP/s", info=True)
    return cfg_best


# ------------------------------------------------------------------------------------------------ MXFP4 section

Q_SWEEP = [  # 8 rows/expert, the PTX byte-permute decodes ("asm", "asm_sign") and the arithmetic one ("bf16").
    # Measured with the Pallas Triton kernel these replaced: an f16-trick decode ("2d": 489 us at 16x64x256 w4)
    # and the codes on fp8 tensor cores ("fp8": correct but 2.4x slower, every small wgmma waited for) lost to them
    # and went with that kernel.
    moe_gpu.GpuConfig(bm=16, bn=64, bk=256, num_warps=4, num_stages=3, dequant="asm"),
    moe_gpu.GpuConfig(bm=16, bn=64, bk=256, num_warps=4, num_stages=3, dequant="asm_sign"),  # +4% over "asm" (H200)
    moe_gpu.GpuConfig(bm=16, bn=64, bk=512, num_warps=4, num_stages=3, dequant="asm_sign"),
    moe_gpu.GpuConfig(bm=16, bn=64, bk=256, num_warps=4, num_stages=4, dequant="asm_sign"),
    moe_gpu.GpuConfig(bm=16, bn=64, bk=512, num_warps=4, num_stages=3, dequant="asm"),
    moe_gpu.GpuConfig(bm=16, bn=128, bk=256, num_warps=4, num_stages=3, dequant="asm"),
    moe_gpu.GpuConfig(bm=16, bn=64, bk=256, num_warps=4, num_stages=4, dequant="asm"),
    moe_gpu.GpuConfig(bm=16, bn=32, bk=512, num_warps=4, num_stages=3, dequant="asm"),
    moe_gpu.GpuConfig(bm=16, bn=64, bk=256, num_warps=8, num_stages=3, dequant="asm"),
    moe_gpu.GpuConfig(bm=16, bn=64, bk=256, num_warps=4, num_stages=3, swap_ab=True, dequant="asm"),
    moe_gpu.GpuConfig(bm=16, bn=64, bk=256, num_warps=4, num_stages=3, dequant="bf16"),
]


def bench_mxfp4(args, copy_bw):
    wq = mx.random_weight(jax.random.key(3), E, K, N)
    wbytes = wq.nbytes
    INFO["mxfp4_weight_bytes"] = wbytes
    w_deq = jax.jit(lambda p, s: mx.dequantize(mx.MXFP4Weight(p, s), jnp.bfloat16))(wq.packed, wq.scale)
    results = {}
    for rows_per_expert in [int(r) for r in args.q_rows.split(",")]:
        if left(args.budget) < 30:
            INFO["notes"].append(f"budget: MXFP4 rows/expert={rows_per_expert} skipped")
            break
        m = E * rows_per_expert
        x = jax.random.normal(jax.random.key(rows_per_expert), (m, K), jnp.bfloat16)
        sizes = jnp.full((E,), rows_per_expert, jnp.int32)
        ref = jax.jit(lambda a, b, g: jax.lax.ragged_dot(a, b, g, preferred_element_type=jnp.float32))(
            x, w_deq, sizes)
        shape = f"E={E} {rows_per_expert} rows/expert {K}->{N} MXFP4"
        if args.q_configs:  # GpuConfig field overrides over the default config at these rows
            d = moe_gpu.default_config(m, E, K, N, True)
            sweep = [dataclasses.replace(d, **o) for o in json.loads(args.q_configs)]
        elif not args.sweep:
            sweep = [None]
        elif rows_per_expert == 8:
            sweep = Q_SWEEP
        else:
            d = moe_gpu.default_config(m, E, K, N, True)
            sweep = [d, dataclasses.replace(d, bn=64, bk=256), dataclasses.replace(d, dequant="asm")]
        best = (None, None)
        for cfg in sweep:
            if left(args.budget) < 25:
                break
            f = jax.jit(lambda a, p, s_, g, cfg=cfg: ops.grouped_matmul(
                a, p, g, w_scale=s_, **KW, out_dtype=jnp.bfloat16, config=cfg))

            def run(f=f, cfg=cfg, x=x, sizes=sizes, ref=ref):
                err = rel_err(f(x, wq.packed, wq.scale, sizes), ref)
                if err > 2e-2:
                    raise AssertionError(f"wrong result, rel err {err:.3g}")
                t = time_jax(f, x, wq.packed, wq.scale, sizes, reps=20)
                INFO.setdefault("mxfp4_sweep_us", {})[f"{rows_per_expert} rows {cfg}"] = t * 1e6
                log(f"MXFP4 {rows_per_expert} rows/expert {cfg}: {wbytes / t / 1e12:.2f} TB/s "
                    f"({t * 1e6:.0f} us, {2 * m * K * N / t / 1e12:.0f} TFLOP/s), err {err:.2e}")
                return t
            t = attempt(f"MXFP4 {rows_per_expert} {cfg}", run)
            if t is not None and (best[0] is None or t < best[0]):
                best = (t, cfg)
        mgpu_runs = []
        for o in json.loads(args.mgpu_configs or "[]"):
            o = dict(o)
            mcfg = dataclasses.replace(mgpu_mx.default_config(rows_per_expert), **{k: v for k, v in o.items()
                                                                                 if k != "layout"})
            mgpu_runs.append((mcfg, o.get("layout", "natural" if mcfg.mma == "fp8" else "placed")))
        for mcfg, layout in mgpu_runs:
            if left(args.budget) < 20:
                break

            def run_mgpu(mcfg=mcfg, layout=layout, x=x, sizes=sizes, ref=ref):
                wp = mgpu_mx.prepare_weight(wq, layout)
                f = jax.jit(lambda a, w_, g: mgpu_mx.grouped_matmul(a, w_, g, config=mcfg, out_dtype=jnp.bfloat16))
                err = rel_err(f(x, wp, sizes), ref)
                if err > 2e-2:
                    raise AssertionError(f"wrong result, rel err {err:.3g}")
                t = time_jax(f, x, wp, sizes, reps=20)
                if mcfg.mma == "bf16" and mcfg.plan == "kernel":  # the kernel alone; the XLA before it
                    prep = jax.jit(lambda a, g: mgpu_mx.prepare_grouped(a, g, mcfg))(x, sizes)
                    fk = jax.jit(lambda xs, b, w_: mgpu_mx.kernel_call_grouped(
                        xs, b, w_, mcfg, mgpu_mx.expert_scale(w_), out_rows=x.shape[0]))
                    tk = time_jax(fk, *prep, wp, reps=20)
                    tp = time_jax(jax.jit(lambda a, g: mgpu_mx.prepare_grouped(a, g, mcfg)), x, sizes, reps=20)
                    tu = 0.0  # the kernel writes the rows in place
                    around = f"x planes + plan {tp * 1e6:.0f} us"
                else:
                    if mcfg.mma == "fp8":  # the kernel alone, on its prepared rows (x planes, tiles)
                        prep = jax.jit(lambda a, g: fp8_mma.prepare_rows_fp8(a, g, E, mcfg.rows)[:5])(x, sizes)
                        prep = (prep[0], prep[1], prep[3], prep[4])
                        fk = jax.jit(lambda xh, xl, tg, nt, w_: fp8_mma.kernel_call_fp8(xh, xl, tg, nt, w_, mcfg))
                    else:
                        prep = jax.jit(lambda a, g: mgpu_mx.prepare_rows(a, g, E, mcfg.rows)[:3])(x, sizes)
                        fk = jax.jit(lambda xs, tg, nt, w_: mgpu_mx.kernel_call(xs, tg, nt, w_, mcfg))
                    tk = time_jax(fk, *prep, wp, reps=20)
                    # the XLA around the kernel, each side alone: the row preparation and the unpadding of out
                    prep_f = fp8_mma.prepare_rows_fp8 if mcfg.mma == "fp8" else mgpu_mx.prepare_rows
                    tp = time_jax(jax.jit(lambda a, g: prep_f(a, g, E, mcfg.rows)), x, sizes, reps=20)
                    _, _, _, pad_row, live = mgpu_mx.prepare_rows(x, sizes, E, mcfg.rows)
                    out = fk(*prep, wp)
                    tu = time_jax(jax.jit(lambda o, pr, lv: mgpu_mx.unpad_output(o, pr, lv, jnp.bfloat16)),
                                  out, pad_row, live, reps=20)
                    around = f"row prep {tp * 1e6:.0f} us, unpad {tu * 1e6:.0f} us"
                INFO.setdefault("mgpu_mxfp4_us", {})[f"{rows_per_expert} rows {mcfg} {layout}"] = dict(
                    op=t * 1e6, kernel=tk * 1e6, prep=tp * 1e6, unpad=tu * 1e6)
                log(f"MXFP4 {rows_per_expert} rows/expert mosaic {mcfg} {layout}: op {wbytes / t / 1e12:.2f} TB/s "
                    f"({t * 1e6:.0f} us), kernel alone {wbytes / tk / 1e12:.2f} TB/s ({tk * 1e6:.0f} us), "
                    f"{around}, err {err:.2e}")
                return t
            t = attempt(f"MXFP4 {rows_per_expert} mosaic {mcfg} {layout}", run_mgpu)
            if t is not None and (best[0] is None or t < best[0]):
                best = (t, mcfg)
        t = best[0]
        results[rows_per_expert] = dict(us=t and t * 1e6, config=str(best[1]))
        row(f"MXFP4 grouped_matmul weight bytes/s vs copy ({rows_per_expert} rows/expert)", shape,
            t and wbytes / t / 1e12, copy_bw / 1e12, 0.7, "TB/s", info=rows_per_expert != 8)
        if rows_per_expert == 8 and left(args.budget) > 30:
            # bf16 weights at the same rows, ours and XLA (information)
            def bf16_decode(x=x, sizes=sizes, ref=ref):
                f = jax.jit(lambda a, b, g: ops.grouped_matmul(a, b, g, **KW, out_dtype=jnp.bfloat16))
                err = rel_err(f(x, w_deq, sizes), ref)
                if err > 2e-2:
                    raise AssertionError(f"wrong result, rel err {err:.3g}")
                tb = time_jax(f, x, w_deq, sizes, reps=20)
                fx = jax.jit(lambda a, b, g: jax.lax.ragged_dot(a, b, g))
                tx = time_jax(fx, x, w_deq, sizes, reps=5, outer=3)
                nb = E * K * N * 2
                log(f"bf16 decode 8 rows/expert: ours {nb / tb / 1e12:.2f} TB/s, XLA ragged_dot {nb / tx / 1e12:.2f}")
                INFO["bf16_decode_read_TBps"] = nb / tb / 1e12
                return nb / tb / 1e12, nb / tx / 1e12
            r = attempt("bf16 decode", bf16_decode)
            if r:
                row("bf16 grouped_matmul decode (8 rows/expert) weight TB/s vs XLA ragged_dot", shape.replace(
                    "MXFP4", "bf16"), r[0], r[1], None, "TB/s", info=True)
    INFO["mxfp4"] = results


# -------------------------------------------------------------------------------- MXFP4 expert FFN, tile layout

def checked_time(f, args, ref, reps):
    """(seconds per call of `f(*args)`, its relative error vs `ref`), refusing to time a wrong result."""
    err = rel_err(f(*args), ref)
    if err > 2e-2:
        raise AssertionError(f"wrong result, rel err {err:.3g}")
    return time_jax(f, *args, reps=reps), err


def bench_ffn(args, copy_bw):
    """The MXFP4 expert FFN on sorted rows (gate, up: K -> N; down: N -> K), weights prepared for the Mosaic kernel:
    the tile-layout FFN (`mgpu_mxfp4.expert_ffn_tiled`: rows padded once, three kernels, one gather back) against
    three `grouped_matmul` calls that each pad and unpad, and one tile-layout matmul on its own (x planes + kernel +
    expert scale, and the kernel alone)."""
    keys = jax.random.split(jax.random.key(11), 3)
    ws = [mx.random_weight(keys[0], E, K, N), mx.random_weight(keys[1], E, K, N), mx.random_weight(keys[2], E, N, K)]
    wp = [mgpu_mx.prepare_weight(q) for q in ws]
    # the model's preparation: gate / up columns in the down matmul's plane order (h handed over as planes)
    prepared = {"natural": wp, "planes": list(mgpu_mx.prepare_ffn_weights(*ws))}
    orders = args.ffn_gate_up_order.split(",")
    wbytes = sum(q.nbytes for q in ws)
    jax.block_until_ready(prepared)
    log("FFN weights drawn and prepared")  # the log's timestamps show where the section's setup time goes
    for rows_per_expert in [int(r) for r in args.ffn_rows.split(",")]:
        if left(args.budget) < 30:
            INFO["notes"].append(f"budget: FFN rows/expert={rows_per_expert} skipped")
            break
        m = E * rows_per_expert
        x = jax.random.normal(jax.random.key(100 + rows_per_expert), (m, K), jnp.bfloat16)
        sizes = ffn_sizes(args.ffn_sizes, 200 + rows_per_expert, m)
        shape = f"E={E} {rows_per_expert} rows/expert ({args.ffn_sizes} sizes, max {int(sizes.max())}) {K}->{N}->{K} MXFP4"
        log(f"FFN {rows_per_expert} rows/expert, {args.ffn_sizes} sizes: max {int(sizes.max())}, "
            f"empty {int((sizes == 0).sum())}, 8-row tiles {int(((sizes + 7) // 8).sum())}, 16-row tiles "
            f"{int(((sizes + 15) // 16).sum())}")
        default = mgpu_mx.tiled_config(rows_per_expert, (N, K))  # the FFN's widths: what the model runs
        configs = [default] + [dataclasses.replace(default, **_config_fields(o))
                               for o in json.loads(args.ffn_configs or "[]")]

        ref = jax.block_until_ready(
            # the weights as arguments: closed over, jit would embed their 1.2 GB in the program as constants
            # (100-146 s to compile and run this line)
            jax.jit(lambda a, g, *w: ops.expert_ffn_sorted(a, g, *w, situ, backend="reference"))(x, sizes, *ws))
        log(f"FFN {rows_per_expert} rows/expert: reference ready")
        # the ceiling: the FFN's FLOPs at a dense bf16 matmul's rate (one weight per matmul, served from L2, no
        # decode, no groups) -> the largest fraction of copy that a kernel doing these FLOPs on bf16 tensor cores
        # can show; at 64 rows per expert it is below the 0.70 bar (docs/performance.md)
        t_ceiling = attempt(f"MXFP4 FFN {rows_per_expert} dense ceiling", lambda: time_jax(
            jax.jit(lambda a, wg, wu, wd: situ(a @ wg, a @ wu).astype(jnp.bfloat16) @ wd),
            x, *[jax.random.normal(k_, s_, jnp.bfloat16)
                 for k_, s_ in zip(jax.random.split(keys[0], 3), ((K, N), (K, N), (N, K)))], reps=20))
        if t_ceiling:
            flops = 2 * m * K * N * 3
            log(f"MXFP4 FFN {rows_per_expert} rows/expert: its FLOPs as dense bf16 matmuls {t_ceiling * 1e6:.0f} us "
                f"({flops / t_ceiling / 1e12:.0f} TFLOP/s) = {wbytes / t_ceiling / copy_bw:.3f} of copy at most")
            row(f"MXFP4 expert FFN ceiling: its FLOPs at a dense bf16 matmul's rate (one weight each, no decode), "
                f"weight bytes/s vs copy ({rows_per_expert} rows/expert)", shape, wbytes / t_ceiling / 1e12,
                copy_bw / 1e12, 0.7, "TB/s", info=True)
        per_mm = jax.jit(lambda a, g, *w: mgpu_mx.grouped_matmul(
            situ(*[mgpu_mx.grouped_matmul(a, w_, g) for w_ in w[:2]]).astype(jnp.bfloat16), w[2], g))

        t_per = None if args.ffn_no_peers else attempt(
            f"MXFP4 FFN {rows_per_expert} per matmul", lambda: checked_time(per_mm, (x, sizes, *wp), ref, reps=20)[0])
        # the Triton MXFP4 kernel on the checkpoint's layout (what the model ran before it re-laid its experts)
        triton = jax.jit(lambda a, g, *w: ops.expert_ffn_sorted(a, g, *w, situ, backend="gpu"))

        def timed_triton(x=x, sizes=sizes, ref=ref, triton=triton, rows_per_expert=rows_per_expert):
            t, _ = checked_time(triton, (x, sizes, *ws), ref, reps=10)
            log(f"MXFP4 FFN {rows_per_expert} rows/expert, Triton kernel (checkpoint layout): {t * 1e6:.0f} us "
                f"({wbytes / t / 1e12:.2f} TB/s of weights)")
            return t
        t_triton = None if args.ffn_no_peers else attempt(f"MXFP4 FFN {rows_per_expert} Triton", timed_triton)

        def run(cfg, order, x=x, sizes=sizes, shape=shape, rows_per_expert=rows_per_expert, ref=ref, t_per=t_per,
                t_triton=t_triton):
            tiled = jax.jit(lambda a, g, *w: mgpu_mx.expert_ffn_tiled(a, g, *w, situ, config=cfg))
            t_tiled, err_t = checked_time(tiled, (x, sizes, *prepared[order]), ref, reps=20)
            t_dispatch = t_tokens = None
            if args.ffn_from_tokens:  # the model's path: x's rows come from m / 16 tokens (top-16)
                n_tok = m // 16
                x_nd = jax.random.normal(jax.random.key(300 + rows_per_expert), (n_tok, K), jnp.bfloat16)
                tok = jnp.asarray(np.random.default_rng(rows_per_expert).permutation(np.arange(m) % n_tok), jnp.int32)
                ref_tok = jax.block_until_ready(jax.jit(lambda a, t, g, *w: ops.expert_ffn_sorted(
                    a[t], g, *w, situ, backend="reference"))(x_nd, tok, sizes, *ws))
                # the dispatch gather, then the FFN on the sorted rows (the old path) ...
                dispatch = jax.jit(lambda a, t, g, *w: mgpu_mx.expert_ffn_tiled(a[t], g, *w, situ, config=cfg))
                t_dispatch, _ = checked_time(dispatch, (x_nd, tok, sizes, *prepared[order]), ref_tok, reps=20)
                # ... against the FFN gathering from the tokens itself (planes made on the tokens)
                from_tokens = jax.jit(lambda a, t, g, *w: mgpu_mx.expert_ffn_tiled(a, g, *w, situ, config=cfg,
                                                                                   token_of_row=t))
                t_tokens, _ = checked_time(from_tokens, (x_nd, tok, sizes, *prepared[order]), ref_tok, reps=20)
                log(f"MXFP4 FFN {rows_per_expert} rows/expert from {n_tok} tokens: dispatch gather + FFN "
                    f"{t_dispatch * 1e6:.0f} us, FFN gathering from the tokens {t_tokens * 1e6:.0f} us; {cfg}")
                # the model's whole MoE path with the combine (top-16 routing of the same tokens): the FFN's rows
                # gathered back to sorted order and then into (token, slot) order (the old path), against
                # the FFN handing them back in slot order (`ops.expert_ffn`)
                rng = np.random.default_rng(400 + rows_per_expert)
                idx = jnp.asarray(np.stack([rng.choice(E, 16, replace=False) for _ in range(n_tok)]), jnp.int32)
                wt = jnp.asarray(rng.random((n_tok, 16)), jnp.float32)
                ref_moe = jax.block_until_ready(jax.jit(lambda a, i, w_, *w: ops.expert_ffn(
                    a, i, w_, *w, situ, backend="reference"))(x_nd, idx, wt, *ws))

                def two_gathers(a, i, w_, *w):
                    o, t, g = ops.sort_tokens(i, E)
                    y = mgpu_mx.expert_ffn_tiled(a, g, *w, situ, config=cfg, token_of_row=t)
                    return ops.combine(y, o, w_)

                def sorted_plan(a, i, w_, *w):  # the previous ops.expert_ffn: sorted rows planned, slot order out
                    _, t, g, slot_row = ops.dispatch_plan(i, E)
                    y = mgpu_mx.expert_ffn_tiled(a, g, *w, situ, config=cfg, token_of_row=t, out_rows=slot_row)
                    return ops.combine_slots(y, w_)

                moe_args = (x_nd, idx, wt, *prepared[order])
                t_two, _ = checked_time(jax.jit(two_gathers), moe_args, ref_moe, reps=20)
                t_sorted, _ = checked_time(jax.jit(sorted_plan), moe_args, ref_moe, reps=20)
                t_moe, _ = checked_time(jax.jit(lambda a, i, w_, *w: ops.expert_ffn(
                    a, i, w_, *w, situ, configs=(cfg, None))), moe_args, ref_moe, reps=20)
                log(f"MXFP4 MoE {rows_per_expert} rows/expert, {n_tok} tokens, plan + FFN + combine: sorted, rows "
                    f"gathered back then into slot order {t_two * 1e6:.0f} us; sorted plan, rows handed back in slot "
                    f"order {t_sorted * 1e6:.0f} us; planned from the pairs (ops.expert_ffn, slot_tile_plan) "
                    f"{t_moe * 1e6:.0f} us")
                INFO.setdefault("moe_path_us", {})[f"{rows_per_expert} rows {cfg}"] = dict(
                    two_gathers=t_two * 1e6, sorted_plan_slot_order=t_sorted * 1e6, slot_tile_plan=t_moe * 1e6)
            t_tiled16 = None
            if cfg.gate_up == "separate" and args.ffn_bf16_gate_up:  # gate and up written in bf16
                tiled16 = jax.jit(lambda a, g, *w: mgpu_mx.expert_ffn_tiled(a, g, *w, situ, config=cfg,
                                                                            gate_up_dtype=jnp.bfloat16))
                t_tiled16, _ = checked_time(tiled16, (x, sizes, *wp), ref, reps=20)
            # one matmul in the tile layout (gate: K -> N), as the FFN runs it
            plan = jax.jit(lambda g: mgpu_mx.tile_plan(g, m, E, cfg.rows))(sizes)
            x_pad = jax.jit(lambda a, p: a.at[p.src].get(mode="fill", fill_value=0))(x, plan)
            t_mm = time_jax(jax.jit(lambda a, p, w_: mgpu_mx.tiled_matmul(a, p, w_, cfg)), x_pad, plan, wp[0],
                            reps=20)
            xs = jax.jit(mgpu_mx._planes_in_contraction_order)(x_pad)
            kcfg = mgpu_mx.fit_config(cfg, K)
            t_k = time_jax(jax.jit(lambda a, p, w_: mgpu_mx.kernel_call(a, p.tile_group, p.num_tiles, w_, kcfg)),
                           xs, plan, wp[0], reps=20)
            b1 = ws[0].nbytes
            INFO.setdefault("ffn_us", {})[f"{rows_per_expert} rows, gate/up {order} {cfg}"] = dict(
                tiled=t_tiled * 1e6, tiled_gate_up_bf16=t_tiled16 and t_tiled16 * 1e6,
                dispatch_then_tiled=t_dispatch and t_dispatch * 1e6, tiled_from_tokens=t_tokens and t_tokens * 1e6,
                per_matmul=t_per and t_per * 1e6, tiled_matmul=t_mm * 1e6, kernel=t_k * 1e6)
            per = f"{t_per * 1e6:.0f} us ({wbytes / t_per / 1e12:.2f})" if t_per else "-"
            bf16 = f" (gate/up written bf16: {t_tiled16 * 1e6:.0f} us)" if t_tiled16 else ""
            log(f"MXFP4 FFN {rows_per_expert} rows/expert: tile layout {t_tiled * 1e6:.0f} us "
                f"({wbytes / t_tiled / 1e12:.2f} TB/s of weights){bf16}, per-matmul padding {per}; one tile-layout matmul "
                f"{t_mm * 1e6:.0f} us ({b1 / t_mm / 1e12:.2f} TB/s), its kernel alone {t_k * 1e6:.0f} us "
                f"({b1 / t_k / 1e12:.2f}); err {err_t:.2e}; gate/up columns {order}; {cfg}")
            info = rows_per_expert != 8
            shape = f"{shape}, gate/up columns {order}"
            row(f"MXFP4 grouped matmul in the FFN's tile layout, weight bytes/s vs copy ({rows_per_expert} "
                "rows/expert)", shape.replace(f"->{K} ", " "), b1 / t_mm / 1e12, copy_bw / 1e12, 0.7, "TB/s",
                info=info)
            row(f"MXFP4 expert FFN (3 matmuls, tile layout), weight bytes/s vs copy ({rows_per_expert} rows/expert)",
                shape, wbytes / t_tiled / 1e12, copy_bw / 1e12, 0.7, "TB/s", info=info)
            row(f"MXFP4 expert FFN: tile layout vs per-matmul padding ({rows_per_expert} rows/expert)", shape,
                t_per and 1e6 * t_per, 1e6 * t_tiled, None, "us (peer / ours = speedup)", info=True)
            row(f"MXFP4 expert FFN: tile layout vs the Triton kernel ({rows_per_expert} rows/expert)", shape,
                t_triton and 1e6 * t_triton, 1e6 * t_tiled, None, "us (peer / ours = speedup)", info=True)
        for cfg in configs:
            for order in orders:
                if left(args.budget) < 20:
                    break
                attempt(f"MXFP4 FFN {rows_per_expert} {order} {cfg}", functools.partial(run, cfg, order))


def _config_fields(overrides: dict) -> dict:
    """`--ffn-configs` overrides as MgpuConfig fields: a "down_config" given as a dict becomes a MgpuConfig."""
    down = overrides.get("down_config")
    return {**overrides, "down_config": mgpu_mx.MgpuConfig(**down)} if isinstance(down, dict) else overrides


def ffn_sizes(kind: str, seed: int, m: int):
    """Group sizes summing to m: "routed" — each row's expert uniform at random (a balanced router's load:
    multinomial, about m/E ± sqrt(m/E)); "cuts" — e − 1 uniform cut points (`random_sizes`: far more skewed,
    many empty experts and a few large); "equal" — m/E each."""
    if kind == "routed":
        counts = np.random.default_rng(seed).multinomial(m, [1 / E] * E)
        return jnp.asarray(counts, jnp.int32)
    if kind == "cuts":
        return random_sizes(jax.random.key(seed), m, E)
    if kind == "equal":
        return jnp.full((E,), m // E, jnp.int32)
    raise ValueError(f"--ffn-sizes must be routed, cuts or equal, not {kind!r}")


# ------------------------------------------------------------------------------------- expert parallel, 2 GPUs

def bench_ep(args):
    from sharding import make_mesh
    from sharding.expert_parallel import ep_expert_ffn, place_experts, place_tokens

    n_dev = len(jax.devices())
    if n_dev < 2:
        INFO["notes"].append("expert parallel: one GPU only, skipped")
        return
    mesh = make_mesh(f"{2}x1", devices=jax.devices()[:2])
    n_tok, D, F, Ee, k = (64, 256, 128, 8, 2) if KW.get("interpret") else (2048, 3584, 3072, 112, 8)
    ks = jax.random.split(jax.random.key(5), 6)
    x = jax.random.normal(ks[0], (n_tok, D), jnp.bfloat16)
    logits = jax.random.normal(ks[1], (n_tok, Ee))
    wt, idx = jax.lax.top_k(jax.nn.sigmoid(logits), k)
    wt = wt / wt.sum(-1, keepdims=True)
    wg = (jax.random.normal(ks[2], (Ee, D, F), jnp.float32) * D ** -0.5).astype(jnp.bfloat16)
    wu = (jax.random.normal(ks[3], (Ee, D, F), jnp.float32) * D ** -0.5).astype(jnp.bfloat16)
    wd = (jax.random.normal(ks[4], (Ee, F, D), jnp.float32) * F ** -0.5).astype(jnp.bfloat16)
    one = jax.jit(lambda *a: ops.expert_ffn(*a, situ, **KW))
    ref = one(x, idx, wt, wg, wu, wd)
    again = one(x, idx, wt, wg, wu, wd)
    same = bool(jnp.all(jax.lax.bitcast_convert_type(ref, jnp.int32) == jax.lax.bitcast_convert_type(again,
                                                                                                     jnp.int32)))
    INFO["deterministic_expert_ffn_gpu"] = same
    log("expert_ffn twice -> same bits:", same)
    t_one = time_jax(one, x, idx, wt, wg, wu, wd, reps=5, outer=3)
    xs, idxs, wts = (place_tokens(a, mesh) for a in (x, idx, wt))
    wgs, wus, wds = (place_experts(a, mesh) for a in (wg, wu, wd))
    ep = {}
    for method in ("ragged", "allgather"):
        if left(args.budget) < 15:
            break

        def run(method=method):
            run_ep = lambda: ep_expert_ffn(xs, idxs, wts, wgs, wus, wds, situ, mesh=mesh,  # noqa: E731
                                           method=method, **KW)
            out = run_ep()
            err = rel_err(out, ref)
            det = bool(np.array_equal(np.asarray(out), np.asarray(run_ep())))
            t = time_jax(run_ep, reps=5, outer=3)
            log(f"EP {method} on 2 GPUs: rel err vs one device {err:.2e}, deterministic {det}, {t * 1e3:.2f} ms "
                f"(one device {t_one * 1e3:.2f} ms)")
            if err > 1e-2:
                raise AssertionError(f"EP {method} disagrees with one device: {err:.3g}")
            return dict(err=err, deterministic=det, ms=t * 1e3)
        ep[method] = attempt(f"EP {method}", run)
        if ep[method]:
            row(f"EP {method} 2 GPUs: time vs one GPU (info)", f"N={n_tok} k={k} E={Ee} {D}->{F}->{D}",
                t_one * 1e3, ep[method]["ms"], None, "ms (ours=1 GPU, peer=EP)", info=True)
    INFO["ep"] = ep


# ------------------------------------------------------------------------------------------------------- table

def print_table():
    print("\nname, shape, ours, peer, ratio, bar, pass/fail")
    for r in ROWS:
        f = lambda v: "-" if v is None else (f"{v:.3g}" if isinstance(v, float) else str(v))  # noqa: E731
        print(f"{r['name']}, {r['shape']}, {f(r['ours'])} {r['unit']}, {f(r['peer'])} {r['unit']}, "
              f"{f(r['ratio'])}, {'-' if r['bar'] is None else '>= ' + str(r['bar'])}, {r['result']}")


def versions():
    v = dict(python=platform.python_version(), jax=jax.__version__, device=str(jax.devices()[0].device_kind),
             n_devices=len(jax.devices()), date=time.strftime("%Y-%m-%d"))
    for mod in ("jaxlib", "torch", "triton"):
        try:
            v[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            v[mod] = None
    return v


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sweep", action="store_true", help="try several block configs per kernel")
    ap.add_argument("--budget", type=float, default=240.0, help="seconds; later sections are skipped past it")
    ap.add_argument("--no-ep", action="store_true")
    ap.add_argument("--mxfp4-only", action="store_true", help="skip the bf16 section")
    ap.add_argument("--q-rows", default="8,32,64", help="MXFP4 section: rows per expert to time")
    ap.add_argument("--q-configs", default="", help="MXFP4 section: JSON list of GpuConfig field overrides of the "
                    "default config, e.g. '[{\"bk\": 128}, {\"bk\": 128, \"num_stages\": 4}]' (instead of --sweep)")
    ap.add_argument("--mgpu-configs", default="", help="MXFP4 section: also time the Mosaic GPU kernel "
                    "(pallas_kernels.moe.mgpu_mxfp4), a JSON list of MgpuConfig field overrides of its default config at "
                    "each rows-per-expert, e.g. '[{}, {\"steps\": 6}]'; a \"layout\" key picks the codes' layout "
                    "(prepare_weight: \"placed\" by default, \"natural\" for the table decode; fp8 needs natural)")
    ap.add_argument("--ffn-rows", default="8", help="MXFP4 expert FFN section (Mosaic kernel, tile layout vs "
                    "per-matmul padding): rows per expert to time, comma-separated; empty skips it")
    ap.add_argument("--ffn-sizes", default="routed", help="FFN section: group sizes — routed (multinomial, a "
                    "balanced router), cuts (uniform cut points, skewed) or equal")
    ap.add_argument("--ffn-configs", default="", help="FFN section: also time the tile layout with these MgpuConfig "
                    "overrides of tiled_config (JSON list), e.g. '[{\"rows\": 16, \"ctas_per_sm\": 4}]'")
    ap.add_argument("--ffn-bf16-gate-up", action="store_true", help="FFN section: also time gate / up written in "
                    "bf16 (`expert_ffn_tiled(gate_up_dtype=...)`; 1%% faster on the H200, inside the spread)")
    ap.add_argument("--ffn-no-peers", action="store_true", help="FFN section: time only the tile layout's configs "
                    "(not the per-matmul padding and the Triton kernel: a config sweep in less device time)")
    ap.add_argument("--ffn-gate-up-order", default="planes", help="FFN section: gate / up output columns "
                    "'planes' (the down matmul's x-plane order, as a model prepares them: h needs no transpose), "
                    "'natural', or both ('planes,natural') timed one after the other")
    ap.add_argument("--ffn-from-tokens", action="store_true", help="FFN section: also time it from m / 16 tokens "
                    "(the model's path), the dispatch gather before the FFN against the FFN gathering from the tokens")
    ap.add_argument("--ffn-only", action="store_true", help="only the MXFP4 expert FFN section (and copy bandwidth)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes through the interpreter (CPU check)")
    args = ap.parse_args()
    if args.smoke:
        global E, M, K, N
        E, M, K, N = 8, 256, 256, 256
        KW["interpret"] = True
        args.ffn_rows = ""  # the Mosaic GPU kernel has no interpreter
    INFO["versions"] = versions()
    log("versions", INFO["versions"])
    copy_bw = attempt("copy bandwidth", copy_bandwidth) or 4.3e12
    reserve = 0 if args.no_ep else 40  # seconds kept for the expert-parallel section
    args.budget -= reserve
    if not (args.mxfp4_only or args.ffn_only):
        attempt("bf16 section", lambda: bench_bf16(args))
    if not args.ffn_only:
        attempt("MXFP4 section", lambda: bench_mxfp4(args, copy_bw))
    if args.ffn_rows:
        attempt("MXFP4 FFN section", lambda: bench_ffn(args, copy_bw))
    args.budget += reserve
    if not args.no_ep:
        attempt("expert-parallel section", lambda: bench_ep(args))
    if INFO.get("bf16_decode_read_TBps") and INFO.get("dense_xla_ms"):
        floor = E * K * N * 2 / (INFO["bf16_decode_read_TBps"] * 1e12)
        INFO["k3_weight_read_floor_ms"] = floor * 1e3
        log(f"K3 bf16 grouped matmul must read {E * K * N * 2 / 1e9:.2f} GB of weights: at the "
            f"{INFO['bf16_decode_read_TBps']:.2f} TB/s our decode kernel reads them, >= {floor * 1e3:.3f} ms = at most "
            f"{INFO['dense_xla_ms'] / 1e3 / floor:.2f}x the dense matmul's speed")
    for n in INFO["notes"]:
        log("note:", n)
    print_table()
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)  # OUT may name a sub-folder per measurement
        with open(os.path.join(out, "moe.json"), "w") as fh:
            json.dump(dict(rows=ROWS, info=INFO), fh, indent=1, default=str)


if __name__ == "__main__":
    main()
