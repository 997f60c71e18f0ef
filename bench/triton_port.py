#!/usr/bin/env python3
"""Issue #48: each GPU kernel family's native Triton kernel (jax-triton) beside the Pallas Triton kernel it replaces
and the family's peer or ceiling, in one run on one GPU.

    source bench/device_env.sh && python3 bench/triton_port.py            # H100 / H200, < 6 minutes
    python3 bench/triton_port.py --smoke    # CPU: tiny shapes, both kernels interpreted (runs the code, no bars)
    python3 bench/triton_port.py --families moe,mla    # a subset of the families (default: all four)

Per family, on the same inputs: (a) the new kernel against the family's reference at its stated error bar, (b) the
old (Pallas Triton) kernel, the new one and the peer / ceiling timed back to back (`_timing.device_seconds`: short
ops as chains of distinct inputs in one program). The bars are the issue's "hold or beat today's ratios":
  indexer  fp8 keys, K3.1 heads (32 × 128), B = 32, 32K / 128K / 1M tokens, `precision="storage"` presets: key
           bytes/s ≥ 0.85 of the copy bandwidth at 1M (the others: new ≥ old), scores within 5e-3 relative RMS of
           the float32 reference on sequence 0's first 32K tokens (the whole row's reference did not fit beside
           the 1M pool on an 80 GB card).
  moe      bf16 grouped matmul, E = 112, M = 16,384 rows in random group sizes, 3584 -> 3072 (the default config):
           TFLOP/s vs a batched dense matmul of the same FLOPs and weight bytes (`bench/moe.py`'s peer; bar:
           new/peer ≥ old/peer, today 0.76 on the H200). MXFP4 grouped matmul on the checkpoint layout (the Triton
           kernel's MXFP4 path; the Mosaic GPU tile-layout FFN is not part of this port and keeps its figures) at
           8 / 32 rows per expert: weight bytes/s vs copy, new ≥ 0.97 old. Errors vs ragged_dot on the dequantised
           weights ≤ 2e-2 (bf16 output).
  kda      prefill B = 1, H = 96, d = 128, bf16, T = 8K / 32K (bench/kda.py's inputs): tokens/s vs fla
           `chunk_kda` (bar: new ≥ 1.2× fla) where fla-core imports; without it, vs the XLA reference at 8K (info)
           and new ≥ 0.97 old. o and final states within 5e-3 relative RMS of the fp32 reference at 8K. Decode
           B = 64 / 256, T = 1, fp32 state pool donated: state bytes read + written per second ≥ 0.85 of copy,
           within 5e-3 of the reference.
  mla      sparse MLA decode, fp8 latent (512 + 64), B = 32, H = 12 (one TP8 shard of K3.1's 96), 32K context,
           top-2048 (16 distinct selections per timing chain: rows from HBM): gathered row bytes/s vs copy, the
           Triton kernel only (`impl="triton"`; the Mosaic kernel is not ported), exact settings and the storage
           preset: new ≥ 0.97 old, within 1e-4 (exact) / 5e-3 (storage) of the reference. The read-only gather
           ceiling (bench/gather_ceiling.py --triton) measured 0.51–0.59 of copy for these rows. Info beside the
           rows: each kernel's own device time per call (CUPTI), to tell kernel time from launch overhead (the
           native kernels are jax-triton custom calls, which XLA's command buffers do not take; the Pallas ones are
           XLA Triton calls, which they do), and the native storage preset with the XLA merge (one launch fewer).
Writes the table `family, name, shape, old, new, peer, new/peer, bar, pass/fail` and $OUT/triton_port.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback

ap = argparse.ArgumentParser()
ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, kernels interpreted, no bars")
ap.add_argument("--families", default="indexer,moe,kda,mla", help="comma-separated: indexer, moe, kda, mla")
ap.add_argument("--budget", type=float, default=330.0, help="seconds; families past it are skipped")
ARGS = ap.parse_args()

def writable_triton_cache() -> None:
    """Triton's cache in a temp dir where TRITON_CACHE_DIR is unset or empty: the device's home may not be writable,
    and jax-triton sets it to "" when imported (it compiles without that cache), after which fla's kernels fail
    with "Could not create or locate cache dir". Called at start and again before fla is imported."""
    if not os.environ.get("TRITON_CACHE_DIR"):
        os.environ["TRITON_CACHE_DIR"] = TRITON_CACHE


TRITON_CACHE = os.path.join(tempfile.gettempdir(), f"triton_cache_{os.getuid()}")
writable_triton_cache()
if ARGS.smoke:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (pallas_kernels.triton_call)
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.7")  # room for torch's copy-bandwidth buffers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from _timing import device_seconds, pipelined_seconds, torch_copy_bandwidth, torch_kernel_seconds  # noqa: E402
from kimi_jax import quant as Q  # noqa: E402
from pallas_kernels.indexer import gpu as igpu  # noqa: E402
from pallas_kernels.indexer import paged as ipaged  # noqa: E402
from pallas_kernels.kda import ops as kda_ops  # noqa: E402
from pallas_kernels.kda import reference as kda_ref  # noqa: E402
from pallas_kernels.mla import sparse as mla_sparse  # noqa: E402
from pallas_kernels.moe import mxfp4 as mx  # noqa: E402
from pallas_kernels.moe import ops as moe_ops  # noqa: E402
from pallas_kernels import triton_ffi  # noqa: E402

T0 = time.time()
ROWS: list[dict] = []
INFO: dict = {}
STORAGE_BAR = 5e-3
PAGE = 64
CHAIN = 16
CHECK_TOKENS = 32768  # the indexer's scores checked against the reference on this many tokens of sequence 0
OLD, NEW = ("gpu_interpret", "triton_interpret") if ARGS.smoke else ("gpu", "triton")


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def row(family, name, shape, old, new, peer, bar, ok):
    """new/peer is the ratio the bar judges (peer: the family's peer, ceiling or copy bandwidth)."""
    ratio = new / peer if new and peer else float("nan")
    if ARGS.smoke and ok is not None:
        bar, ok = f"{bar} (smoke: not judged)", None
    ROWS.append(dict(family=family, name=name, shape=shape, old=old, new=new, peer=peer, ratio=ratio, bar=bar,
                     result=("pass" if ok else "FAIL") if ok is not None else "info"))


def rel_rms(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b ** 2))) if np.all(np.isfinite(a)) else float("nan")


def seconds(fn, *args, stacked=()):
    if ARGS.smoke:
        jax.block_until_ready(fn(*args))
        return pipelined_seconds(fn, *args, reps=1, rounds=1)
    return device_seconds(fn, *args, stacked=stacked)[0]


def attempt(label, fn):
    """fn() or None, its error kept in INFO (so the old kernel's figures survive a failing new one)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        INFO.setdefault("errors", {})[label] = f"{type(e).__name__}: {str(e)[:400]}"
        return None


def copy_bandwidth() -> float:
    if ARGS.smoke:
        return 1e9
    try:
        return torch_copy_bandwidth(1 << 31)
    except Exception as e:  # noqa: BLE001  (no CUDA torch: an XLA read + write pass)
        INFO["copy_torch_error"] = repr(e)
        x = jax.random.bits(jax.random.PRNGKey(0), (1 << 29,), jnp.uint32)
        return 2 * x.nbytes / seconds(jax.jit(lambda v: v ^ jnp.uint32(1)), x)


def random_fp8(key, shape):
    """e4m3 codes with random sign, exponent ≤ 7, mantissa: |x| ≤ 1.875, never NaN (bit 6 cleared). Drawn as uint32
    words split into bytes: `random.bits(..., uint8)` widens every byte to a uint32 on the way (8 GiB for a 2 GiB
    pool, which ran an H100 out of memory)."""
    assert shape[-1] % 4 == 0, shape
    words = jax.random.bits(key, tuple(shape[:-1]) + (shape[-1] // 4,), jnp.uint32)
    codes = jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(shape)
    return jax.lax.bitcast_convert_type(codes & jnp.uint8(0xBF), jnp.float8_e4m3fn)


# ------------------------------------------------------------------------------------------------ indexer

def bench_indexer(bw):
    hi, d = (4, 64) if ARGS.smoke else (32, 128)
    contexts, B = ((1024,), 2) if ARGS.smoke else ((32768, 131072, 1 << 20), 32)
    fmt = Q.IndexKeyFormat("fp8", d)
    for ctx in contexts:
        key = jax.random.PRNGKey(ctx)
        key_bytes = B * ctx * fmt.bytes_per_token
        # distinct key sets per timing chain (see _timing), at most 2 GB of them: each set is already past the L2,
        # and 16 sets of 128K keys (8.6 GB, drawn through as much again) ran an H100 out of memory
        copies = 1 if ARGS.smoke else max(1, min(CHAIN, int(2e9 // key_bytes)))
        nb = copies * B * (ctx // PAGE) + 1
        bt_all = jax.random.permutation(key, jnp.arange(1, nb, dtype=jnp.int32)).reshape(copies, B, ctx // PAGE)
        bt = bt_all[0]
        parts = (random_fp8(jax.random.fold_in(key, 1), (nb, PAGE, d)),
                 jnp.exp2(jax.random.randint(jax.random.fold_in(key, 2), (nb, PAGE, 1), -6, -1).astype(jnp.float32)))
        r = np.random.default_rng(ctx)
        q = jnp.asarray(r.standard_normal((B, hi, d)), jnp.float32)
        w = jnp.asarray(r.standard_normal((B, hi)) * (hi * d) ** -0.5, jnp.float32)
        pos = jnp.full((B,), ctx - 1, jnp.int32)
        preset = igpu.storage_preset(ctx)
        kw = dict(igpu.FAST[preset], **(dict(tokens_per_program=256) if ARGS.smoke else {}))
        fns = {b: jax.jit(lambda q, w, parts, bt, pos, b=b: ipaged.kernel_scores(q, w, parts, bt, pos, fmt=fmt,
                                                                                  backend=b, **kw))
               for b in (OLD, NEW)}
        n_chk = min(ctx, CHECK_TOKENS)  # the reference on a prefix: at 1M its full row did not fit beside the pool
        # the prefix's pages gathered on the device, dequantised and scored on the host (float64): device-side
        # dequantisation beside the pool asked an H100 for 8 GiB and the einsum an H200 for 32 GiB
        rows0 = [np.asarray(p[bt[0, : n_chk // PAGE]]).reshape(n_chk, p.shape[-1]) for p in parts]
        with jax.default_device(jax.devices("cpu")[0]):
            keys0 = np.asarray(fmt.dequantize(tuple(jnp.asarray(r) for r in rows0)), np.float64)
        s_ref = np.asarray(w[0], np.float64) @ np.maximum(np.asarray(q[0], np.float64) @ keys0.T, 0.0)
        del keys0
        shape = f"ctx={ctx} B={B} Hi={hi} d={d} fp8 keys [storage: {preset}]"
        errs, times = {}, {}
        stacked = () if copies == 1 else (3,)
        for b, f in fns.items():
            def run(f=f):
                err = rel_rms(np.asarray(f(q, w, parts, bt, pos)[0, :n_chk]), s_ref)
                return err, seconds(f, q, w, parts, bt_all if copies > 1 else bt, pos, stacked=stacked)
            errs[b], times[b] = attempt(f"indexer ctx={ctx} {b}", run) or (float("nan"), float("nan"))
        ok = errs[NEW] <= STORAGE_BAR
        old_bw, new_bw = key_bytes / times[OLD], key_bytes / times[NEW]
        bar = ">= 0.85 of copy" if ctx == 1 << 20 else "new >= 0.97 old"
        judged = new_bw / bw >= 0.85 if ctx == 1 << 20 else new_bw >= 0.97 * old_bw
        row("indexer", "score kernel key bytes/s vs copy (TB/s)", shape + f" err {errs[NEW]:.1e}",
            old_bw / 1e12, new_bw / 1e12, bw / 1e12, bar, bool(ok and judged))
        INFO[f"indexer_ctx{ctx}"] = dict(us_old=times[OLD] * 1e6, us_new=times[NEW] * 1e6, err_old=errs[OLD],
                                         err_new=errs[NEW])
        log(f"indexer {shape}: old {times[OLD] * 1e6:.1f} us, new {times[NEW] * 1e6:.1f} us "
            f"({new_bw / bw:.3f} of copy), err old {errs[OLD]:.1e} new {errs[NEW]:.1e}")


# ------------------------------------------------------------------------------------------------ moe

def random_sizes(key, m, e):
    """Random group sizes summing to m: e − 1 uniform cut points (as bench/moe.py)."""
    cuts = jnp.sort(jax.random.randint(key, (e - 1,), 0, m + 1))
    return jnp.diff(jnp.concatenate([jnp.zeros(1, jnp.int32), cuts, jnp.full((1,), m, jnp.int32)])).astype(jnp.int32)


def _moe_times(x, w, sizes, ref, interpret):
    """(old, new) seconds and the new kernel's error of one grouped matmul (bf16 output, default configs)."""
    times, err = {}, float("nan")
    for name, b in (("old", "gpu"), ("new", "triton")):
        f = jax.jit(lambda a, ww, g, b=b: moe_ops.grouped_matmul(a, ww, g, backend=b, out_dtype=jnp.bfloat16,
                                                                 interpret=interpret))

        def run(f=f):
            a, r = np.asarray(f(x, w, sizes), np.float32), np.asarray(ref, np.float32)
            return float(np.abs(a - r).max() / np.abs(r).max()), seconds(f, x, w, sizes)
        e, times[name] = attempt(f"moe {x.shape} {name}", run) or (float("nan"), float("nan"))
        if name == "new":
            err = e
    return times, err


def bench_moe(bw):
    E, M, K, N = (4, 256, 128, 64) if ARGS.smoke else (112, 16384, 3584, 3072)
    kx, kw, ks = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (M, K), jnp.bfloat16)
    w = (jax.random.normal(kw, (E, K, N), jnp.float32) * K ** -0.5).astype(jnp.bfloat16)
    sizes = random_sizes(ks, M, E)
    ref = jax.jit(lambda a, b, g: jax.lax.ragged_dot(a, b, g, preferred_element_type=jnp.float32))(x, w, sizes)
    times, err = _moe_times(x, w, sizes, ref, ARGS.smoke)
    me = M // E
    t_peer = seconds(jax.jit(lambda a, b: jnp.einsum("emk,ekn->emn", a, b)), x[: E * me].reshape(E, me, K), w)
    flops, flops_peer = 2.0 * M * K * N, 2.0 * E * me * K * N
    old, new, peer = (flops / times["old"] / 1e12, flops / times["new"] / 1e12, flops_peer / t_peer / 1e12)
    row("moe", "bf16 grouped matmul vs batched dense matmul (TFLOP/s)", f"E={E} M={M} {K}->{N} err {err:.1e}",
        old, new, peer, "new/peer >= 0.97 old/peer", bool(err <= 2e-2 and new >= 0.97 * old))
    log(f"moe bf16: old {times['old'] * 1e3:.3f} ms, new {times['new'] * 1e3:.3f} ms, batched dense "
        f"{t_peer * 1e3:.3f} ms; err {err:.1e}")
    del w, ref
    wq = mx.random_weight(jax.random.key(3), E, K, N)
    w_deq = mx.dequantize(wq, jnp.bfloat16)
    for rows in (8, 32):
        m = E * rows
        xq = jax.random.normal(jax.random.key(rows), (m, K), jnp.bfloat16)
        sizes_q = jnp.full((E,), rows, jnp.int32)
        ref = jax.lax.ragged_dot(xq, w_deq, sizes_q, preferred_element_type=jnp.float32)
        times, err = _moe_times(xq, wq, sizes_q, ref, ARGS.smoke)
        old, new = wq.nbytes / times["old"], wq.nbytes / times["new"]
        ok = bool(err <= 2e-2 and new >= 0.97 * old)
        row("moe", "MXFP4 grouped matmul weight bytes/s vs copy (TB/s)", f"E={E} {rows} rows/expert {K}->{N} "
            f"err {err:.1e}", old / 1e12, new / 1e12, bw / 1e12, "new >= 0.97 old", ok)
        log(f"moe MXFP4 {rows} rows/expert: old {times['old'] * 1e6:.0f} us, new {times['new'] * 1e6:.0f} us "
            f"({new / bw:.3f} of copy); err {err:.1e}")


# ------------------------------------------------------------------------------------------------ kda

def kda_inputs(key, B, T, H, d):
    """bench/kda.py's inputs: l2-normalised bf16 q, k; bf16 v; g in the K3 gate's range (−5, 0); β in (0, 1)."""
    kq, kk, kv, kg, kb = jax.random.split(key, 5)
    q = kda_ref.l2norm(jax.random.normal(kq, (B, T, H, d), jnp.float32)).astype(jnp.bfloat16)
    k = kda_ref.l2norm(jax.random.normal(kk, (B, T, H, d), jnp.float32)).astype(jnp.bfloat16)
    v = jax.random.normal(kv, (B, T, H, d), jnp.bfloat16)
    g = -5.0 * jax.nn.sigmoid(jax.random.normal(kg, (B, T, H, d), jnp.float32) * 2.0 - 1.0)
    beta = jax.nn.sigmoid(jax.random.normal(kb, (B, T, H), jnp.float32))
    return q, k, v, g, beta


def fla_prefill_seconds(q, k, v, g, beta):
    """fla-core's `chunk_kda` on the same inputs (torch CUDA events), or None where fla does not import."""
    writable_triton_cache()  # again: jax-triton, imported since, empties it
    try:
        import torch
        from fla.ops.kda import chunk_kda
    except Exception as e:  # noqa: BLE001
        INFO.setdefault("fla_missing", f"{type(e).__name__}: {e}")
        return None
    from _timing import torch_event_seconds

    tq, tk, tv, tg, tb = (torch.from_dlpack(x) for x in (q, k, v, g, beta))
    return torch_event_seconds(lambda i: chunk_kda(tq, tk, tv, tg, tb, scale=q.shape[-1] ** -0.5,
                                                   output_final_state=True))


def bench_kda(bw):
    H, d = (2, 32) if ARGS.smoke else (96, 128)
    for T in ((128,) if ARGS.smoke else (8192, 32768)):
        q, k, v, g, beta = kda_inputs(jax.random.PRNGKey(T), 1, T, H, d)
        fns = {b: jax.jit(lambda *a, b=b: kda_ops.chunk(*a, backend=b)) for b in (OLD, NEW)}
        times, errs = {}, {}
        ref = None
        if T <= 8192:
            ref = jax.jit(lambda *a: kda_ops.chunk(*a, backend="reference"))
            o_r, s_r = ref(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), g, beta)
        for b, f in fns.items():
            def run(f=f):
                o, s = f(q, k, v, g, beta)
                err = max(rel_rms(o.astype(jnp.float32), o_r), rel_rms(s, s_r)) if ref is not None else float("nan")
                return err, seconds(f, q, k, v, g, beta)
            errs[b], times[b] = attempt(f"kda prefill T={T} {b}", run) or (float("nan"), float("nan"))
        if ref is not None:
            del o_r, s_r
        t_fla = None if ARGS.smoke else attempt(f"kda fla T={T}", lambda: fla_prefill_seconds(q, k, v, g, beta))
        shape = f"B=1 T={T} H={H} d={d} bf16" + (f" err {errs[NEW]:.1e}" if ref is not None else "")
        ok_err = not (ref is not None and not errs[NEW] <= 5e-3)
        tok = {b: T / times[b] for b in times}
        if t_fla:
            row("kda", "prefill tokens/s vs fla chunk_kda (Mtok/s)", shape, tok[OLD] / 1e6, tok[NEW] / 1e6,
                T / t_fla / 1e6, "new >= 1.2x fla", bool(ok_err and tok[NEW] >= 1.2 * T / t_fla))
        else:
            t_ref = attempt(f"kda xla T={T}", lambda: seconds(ref, q, k, v, g, beta)) if ref is not None else None
            row("kda", "prefill tokens/s vs the XLA reference (Mtok/s; fla not installed)", shape, tok[OLD] / 1e6,
                tok[NEW] / 1e6, T / t_ref / 1e6 if t_ref else None, "new >= 0.97 old",
                bool(ok_err and tok[NEW] >= 0.97 * tok[OLD]))
        INFO[f"kda_prefill_T{T}"] = dict(ms_old=times[OLD] * 1e3, ms_new=times[NEW] * 1e3, err_old=errs[OLD],
                                         err_new=errs[NEW], ms_fla=t_fla * 1e3 if t_fla else None)
        log(f"kda prefill T={T}: old {times[OLD] * 1e3:.2f} ms, new {times[NEW] * 1e3:.2f} ms, "
            f"fla {t_fla * 1e3 if t_fla else float('nan'):.2f} ms; err old {errs[OLD]:.1e} new {errs[NEW]:.1e}")
        del q, k, v, g, beta

    for B in ((2,) if ARGS.smoke else (64, 256)):
        q, k, v, g, beta = kda_inputs(jax.random.PRNGKey(B), B, 1, H, d)
        S = B + 3
        pool = jax.random.normal(jax.random.PRNGKey(B + 1), (S, H, d, d), jnp.float32) * 0.1
        slots = jnp.asarray(np.random.default_rng(B).permutation(S)[:B], jnp.int32)
        o_r, pool_r = kda_ref.recurrent_slots(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), g,
                                              beta, pool, slots)
        want = np.asarray(pool_r[slots])
        del pool_r
        times, errs = {}, {}
        for b in (OLD, NEW):
            step = jax.jit(lambda q, k, v, g, beta, pool, slots, b=b: kda_ops.recurrent(
                q, k, v, g, beta, pool, slot_ids=slots, backend=b), donate_argnums=5)

            def run(step=step):
                o, p = step(q, k, v, g, beta, jnp.array(pool), slots)
                err = max(rel_rms(o.astype(jnp.float32), o_r), rel_rms(p[slots], want))
                state = {"p": p}

                def one():  # the pool is donated and threaded through, as in a decode loop
                    o, state["p"] = step(q, k, v, g, beta, state["p"], slots)
                    return o
                one()
                return err, pipelined_seconds(one, reps=1 if ARGS.smoke else 50, rounds=1 if ARGS.smoke else 3)
            errs[b], times[b] = attempt(f"kda decode B={B} {b}", run) or (float("nan"), float("nan"))
        nbytes = 2 * B * H * d * d * 4
        old_bw, new_bw = nbytes / times[OLD], nbytes / times[NEW]
        row("kda", "decode state bytes/s vs copy (TB/s)", f"B={B} H={H} d={d} fp32 state err {errs[NEW]:.1e}",
            old_bw / 1e12, new_bw / 1e12, bw / 1e12, ">= 0.85 of copy", bool(errs[NEW] <= 5e-3 and new_bw >= 0.85 * bw))
        INFO[f"kda_decode_B{B}"] = dict(us_old=times[OLD] * 1e6, us_new=times[NEW] * 1e6, err_old=errs[OLD],
                                        err_new=errs[NEW])
        log(f"kda decode B={B}: old {times[OLD] * 1e6:.1f} us, new {times[NEW] * 1e6:.1f} us "
            f"({new_bw / bw:.3f} of copy); err old {errs[OLD]:.1e} new {errs[NEW]:.1e}")


# ------------------------------------------------------------------------------------------------ mla

def bench_mla(bw):
    B, H, ctx, k, R, rope = (2, 4, 1024, 64, 64, 16) if ARGS.smoke else (32, 12, 32768, 2048, 512, 64)
    fmt = Q.LatentFormat("fp8", R, rope)
    copies = 1 if ARGS.smoke else CHAIN
    key = jax.random.PRNGKey(7)
    nb = B * (ctx // PAGE) + 1
    bt = jax.random.permutation(key, jnp.arange(1, nb, dtype=jnp.int32)).reshape(B, ctx // PAGE)
    parts = (random_fp8(jax.random.fold_in(key, 1), (nb, PAGE, R + rope)),)
    r = np.random.default_rng(0)
    idx_all = jnp.asarray(np.stack([np.stack([np.sort(r.permutation(ctx)[:k]) for _ in range(B)])
                                    for _ in range(copies)]).astype(np.int32))
    q = jnp.asarray(r.standard_normal((B, H, R + rope)), jnp.float32)
    kw = dict(fmt=fmt, layer_scale=jnp.float32(0.5), scale=192 ** -0.5, value_dim=R)
    o_r, lse_r = mla_sparse.decode(q, parts, bt, idx_all[0], backend="reference", **kw)
    nbytes = B * k * fmt.bytes_per_token
    for precision, bar in (("exact", 1e-4), ("storage", STORAGE_BAR)):
        times, errs, kern, extra = {}, {}, {}, {}
        for b in (OLD, NEW):
            f = jax.jit(lambda q, parts, bt, idx, b=b: mla_sparse.sparse_mla(
                q[:, None], parts, bt, idx[:, None], backend=b, precision=precision, kernel_kw=dict(impl="triton"),
                **kw))

            def run(f=f):
                o, lse = f(q, parts, bt, idx_all[0])
                err = max(rel_rms(o[:, 0], o_r), rel_rms(lse[:, 0], lse_r))
                if copies == 1:
                    return err, seconds(f, q, parts, bt, idx_all[0])
                return err, seconds(f, q, parts, bt, idx_all, stacked=(3,))
            errs[b], times[b] = attempt(f"mla {precision} {b}", run) or (float("nan"), float("nan"))
            if not ARGS.smoke:
                kern[b] = attempt(f"mla {precision} {b} kernels", lambda f=f: {
                    k: v * 1e6 for k, v in torch_kernel_seconds(f, q, parts, bt, idx_all[0]).items()})
        if precision == "storage":  # one launch fewer: the split merge in XLA instead of the merge kernel
            f = jax.jit(lambda q, parts, bt, idx: mla_sparse.sparse_mla(
                q[:, None], parts, bt, idx[:, None], backend=NEW, precision=precision,
                kernel_kw=dict(impl="triton", merge="xla"), **kw))
            t_xla = attempt("mla storage new merge=xla", lambda: seconds(
                f, q, parts, bt, idx_all if copies > 1 else idx_all[0], stacked=(3,) if copies > 1 else ()))
            extra["us_new_merge_xla"] = t_xla * 1e6 if t_xla else None
        old_bw, new_bw = nbytes / times[OLD], nbytes / times[NEW]
        row("mla", f"sparse decode ({precision}) row bytes/s vs copy (TB/s)",
            f"B={B} H={H} ctx={ctx} top-{k} fp8 err {errs[NEW]:.1e}", old_bw / 1e12, new_bw / 1e12, bw / 1e12,
            "new >= 0.97 old", bool(errs[NEW] <= bar and new_bw >= 0.97 * old_bw))
        INFO[f"mla_{precision}"] = dict(us_old=times[OLD] * 1e6, us_new=times[NEW] * 1e6, err_old=errs[OLD],
                                        err_new=errs[NEW], kernels_us_old=kern.get(OLD),
                                        kernels_us_new=kern.get(NEW), **extra)
        log(f"mla {precision}: old {times[OLD] * 1e6:.1f} us, new {times[NEW] * 1e6:.1f} us ({new_bw / bw:.3f} of "
            f"copy); err old {errs[OLD]:.1e} new {errs[NEW]:.1e}; kernels (us per call) old {kern.get(OLD)} "
            f"new {kern.get(NEW)}" + (f"; new with the XLA merge {extra['us_new_merge_xla'] or float('nan'):.1f} us"
                                      if extra else ""))

    # what the engine runs: the storage preset with no impl given, so each side's own choice of kernel (the Mosaic
    # one-launch kernel at B >= MGPU_MIN_BATCH, its Triton kernel below), and the Mosaic kernel itself beside them
    # (the batch where it overtakes the native Triton kernel is where the native path should switch)
    for b_sz in (() if ARGS.smoke else (1, 4, 8, 16, 32)):
        args = (q[:b_sz], parts, bt[:b_sz], idx_all[:, :b_sz])
        times, errs = {}, {}
        # "triton_legacy": the native kernel launched as jax-triton's legacy custom call (`triton_ffi.USE_FFI`
        # off while it lowers), the others as the typed-FFI call that command buffers capture
        for name, b, kk in (("old", OLD, {}), ("new", NEW, {}), ("mgpu", NEW, dict(impl="mgpu")),
                            ("triton", NEW, dict(impl="triton")), ("triton_legacy", NEW, dict(impl="triton"))):
            f = jax.jit(lambda q, parts, bt, idx, b=b, kk=kk: mla_sparse.sparse_mla(
                q[:, None], parts, bt, idx[:, None], backend=b, precision="storage", kernel_kw=kk, **kw))

            def run(f=f):
                o, lse = f(*args[:3], args[3][0])
                err = max(rel_rms(o[:, 0], o_r[:b_sz]), rel_rms(lse[:, 0], lse_r[:b_sz]))
                return err, seconds(f, *args, stacked=(3,))
            triton_ffi.USE_FFI = name != "triton_legacy"
            try:
                errs[name], times[name] = attempt(f"mla shipped B={b_sz} {name}", run) or (float("nan"),
                                                                                           float("nan"))
            finally:
                triton_ffi.USE_FFI = True
        nbytes_b = b_sz * k * fmt.bytes_per_token
        row("mla", "sparse decode (storage, each side's kernel choice) row bytes/s vs copy (TB/s)",
            f"B={b_sz} H={H} ctx={ctx} top-{k} fp8 err {errs['new']:.1e}", nbytes_b / times["old"] / 1e12,
            nbytes_b / times["new"] / 1e12, bw / 1e12, "new >= 0.97 old",
            bool(errs["new"] <= STORAGE_BAR and times["new"] <= times["old"] / 0.97))
        INFO[f"mla_shipped_B{b_sz}"] = {f"us_{n}": t * 1e6 for n, t in times.items()} | {
            f"err_{n}": e for n, e in errs.items()} | {"min_batch": mla_sparse.MGPU_MIN_BATCH}
        log(f"mla storage shipped B={b_sz}: " + ", ".join(f"{n} {t * 1e6:.1f} us" for n, t in times.items()))


# ------------------------------------------------------------------------------------------------ driver

FAMILIES = {"indexer": bench_indexer, "moe": bench_moe, "kda": bench_kda, "mla": bench_mla}


def print_table():
    head = ("family", "name", "shape", "old", "new", "peer", "new/peer", "bar", "result")
    print("\n" + " | ".join(head))
    for r in ROWS:
        f = lambda x: f"{x:.4g}" if isinstance(x, float) else str(x)  # noqa: E731
        print(" | ".join(f(r[k]) for k in ("family", "name", "shape", "old", "new", "peer", "ratio", "bar",
                                           "result")))


def versions() -> dict:
    out = {"jax": jax.__version__, "devices": [str(d) for d in jax.devices()]}
    for mod in ("jaxlib", "triton", "jax_triton", "torch"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001
            out[mod] = f"unavailable: {type(e).__name__}"
    return out


def main():
    INFO["versions"] = versions()
    log(INFO["versions"])
    if not ARGS.smoke:  # the native kernels' PTX paths (MXFP4 decode) are compiled in only where this is True
        from pallas_kernels.triton_call import _device_is_nvidia
        INFO["native_kernels_on_nvidia"] = _device_is_nvidia()
        log(f"native kernels compiled for NVIDIA (inline PTX): {INFO['native_kernels_on_nvidia']}")
        INFO["ffi_triton_call"] = triton_ffi.ffi_target_registered()
        log(f"jaxlib registers {triton_ffi.FFI_TARGET} (native launches capturable): {INFO['ffi_triton_call']}")
    bw = copy_bandwidth()
    INFO["copy_TBps"] = bw / 1e12
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    for fam in ARGS.families.split(","):
        if time.time() - T0 > ARGS.budget:
            row(fam, "skipped: past --budget", "", None, None, None, "", False)
            continue
        try:
            FAMILIES[fam](bw)
        except Exception as e:  # noqa: BLE001  (one family's failure leaves the others' rows)
            traceback.print_exc()
            row(fam, f"ERROR {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}", "", None, None,
                None, "", False)
    print_table()
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "triton_port.json"), "w") as fh:
            json.dump(dict(rows=ROWS, info=INFO, seconds=time.time() - T0), fh, indent=1, default=str)


if __name__ == "__main__":
    main()
