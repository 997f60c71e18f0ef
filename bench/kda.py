"""KDA kernels on a GPU: ours (native Triton through jax-triton, `pallas_kernels.kda.gpu_triton`) and the XLA
reference vs fla-core, in one run.

    python3 bench/kda.py [--quick]

Needs a CUDA GPU, jax with CUDA, torch and fla-core (`from fla.ops.kda import chunk_kda, fused_recurrent_kda`).
Checks correctness first (ours vs the fp32 reference and vs fla, relative RMS), then times:
  prefill  B=1, H=96, d=128, bf16, T in {8K, 32K, 128K} + one varlen batch: tokens/s, bar ≥ 1.0× fla chunk_kda;
  decode   batch {1, 64, 256}, T=1, fp32 state pool (slot ids, donated): state bytes read+written per second,
           bar ≥ 80% of the measured device copy bandwidth at batch ≥ 64; fla fused_recurrent_kda timed beside it.
Prints `name, shape, ours, peer, ratio, bar, pass/fail` last; writes $OUT/kda.json when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from _timing import pipelined_seconds  # noqa: E402
from pallas_kernels.kda import ops, reference as R  # noqa: E402

H, D = 96, 128
ROWS = []
INFO = {}
T0 = time.time()
BUDGET = [1e9]
EXACT = dict(fast_diag=False, fast_inverse=False)  # the variant every other one falls back to


def left():
    return BUDGET[0] - (time.time() - T0)


def row(name, shape, ours, peer, ratio, bar, ok):
    ROWS.append(dict(name=name, shape=shape, ours=ours, peer=peer, ratio=ratio, bar=bar,
                     result=("pass" if ok else "FAIL") if ok is not None else "info"))


def rel(a, b):
    a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
    if not np.all(np.isfinite(a)):
        return float("nan")
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b ** 2)))


def time_jax(fn, *args, reps=20, warm=3):
    """Seconds per call: `reps` back-to-back dispatches and one sync (host dispatch overlaps device work, as it
    does in a serving loop), median of 3 such rounds."""
    for _ in range(warm):
        jax.block_until_ready(fn(*args))
    return pipelined_seconds(fn, *args, reps=reps)


def time_torch(fn, reps=20, warm=3):
    import torch
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) / 1e3)
    return statistics.median(ts)


def make_inputs(T, seed, B=1):
    key = jax.random.PRNGKey(seed)
    kq, kk, kv, kg, kb = jax.random.split(key, 5)
    q = R.l2norm(jax.random.normal(kq, (B, T, H, D), jnp.float32)).astype(jnp.bfloat16)
    k = R.l2norm(jax.random.normal(kk, (B, T, H, D), jnp.float32)).astype(jnp.bfloat16)
    v = jax.random.normal(kv, (B, T, H, D), jnp.bfloat16)
    # K3 lower-bound gate range: g in (−5, 0)
    g = -5.0 * jax.nn.sigmoid(jax.random.normal(kg, (B, T, H, D), jnp.float32) * 2.0 - 1.0)
    beta = jax.nn.sigmoid(jax.random.normal(kb, (B, T, H), jnp.float32))
    return q, k, v, g, beta


def to_torch(x):
    import torch
    return torch.from_dlpack(x)


def fla_chunk(q, k, v, g, beta, cu=None):
    from fla.ops.kda import chunk_kda
    import torch
    tq, tk, tv, tg, tb = map(to_torch, (q, k, v, g, beta))
    tcu = torch.as_tensor(np.asarray(cu), dtype=torch.long, device=tq.device) if cu is not None else None
    call = lambda: chunk_kda(tq, tk, tv, tg, tb, scale=D ** -0.5, output_final_state=True, cu_seqlens=tcu)
    return call


def _compiles(fn, *args):
    try:
        jax.block_until_ready(fn(*args))
        return True
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        return False


def bench_prefill(quick):
    from pallas_kernels.kda import gpu_triton as gpu
    Ts = [8192, 32768] if quick else [8192, 32768, 131072]
    ours = jax.jit(lambda q, k, v, g, b: ops.chunk(q, k, v, g, b, backend="gpu"))
    xla_ref = jax.jit(lambda q, k, v, g, b: ops.chunk(q, k, v, g, b, backend="reference"))
    # correctness at 8K: ours vs reference (fp32 math) and vs fla
    q, k, v, g, beta = make_inputs(8192, 0)
    if not _compiles(ours, q, k, v, g, beta):  # a tuning that does not compile here: fall back to the exact one
        gpu.TUNING.update(EXACT)
        INFO["tuning_fallback"] = dict(EXACT)
        print("prefill: tuning failed to compile; falling back to", EXACT, flush=True)
        ours = jax.jit(lambda q, k, v, g, b: ops.chunk(q, k, v, g, b, backend="gpu"))
    o, s = ours(q, k, v, g, beta)
    o_r, s_r = xla_ref(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), g, beta)
    INFO["prefill_8k_rel_rms_vs_reference"] = dict(o=rel(o, o_r), state=rel(s, s_r))
    try:
        call = fla_chunk(q, k, v, g, beta)
        o_f, s_f = call()
        o_f = jnp.asarray(np.asarray(o_f.float().cpu()))
        s_f = jnp.asarray(np.asarray(s_f.float().cpu()))
        INFO["prefill_8k_rel_rms_vs_fla"] = dict(o=rel(o, o_f), state=rel(s, s_f))
        INFO["fla_8k_rel_rms_vs_reference"] = dict(o=rel(o_f, o_r), state=rel(s_f, s_r))
    except Exception as e:  # noqa: BLE001
        INFO["fla_error"] = repr(e)
        traceback.print_exc()
    print("correctness:", json.dumps(INFO), flush=True)
    ok_corr = INFO["prefill_8k_rel_rms_vs_reference"]["o"] < 5e-3 and INFO["prefill_8k_rel_rms_vs_reference"]["state"] < 5e-3
    row("kda prefill correctness", "T=8K", INFO["prefill_8k_rel_rms_vs_reference"]["o"], 5e-3, None, "rel RMS < 5e-3",
        ok_corr)
    del o_r, s_r

    cases = [(f"T={T // 1024}K", T, None) for T in Ts]
    rng = np.random.default_rng(0)
    lens = rng.integers(64, 2048, size=40)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    cases.append((f"varlen N=40 T={int(cu[-1])}", int(cu[-1]), cu))
    for label, T, cu in cases:
        if left() < 15:
            print(f"prefill {label}: skipped (budget)", flush=True)
            continue
        del q, k, v, g, beta
        q, k, v, g, beta = make_inputs(T, 1)
        try:
            if cu is None:
                t_ours = time_jax(ours, q, k, v, g, beta, reps=10)
            else:
                ours_v = jax.jit(lambda q, k, v, g, b: ops.chunk(q, k, v, g, b, cu_seqlens=cu, backend="gpu"))
                t_ours = time_jax(ours_v, q, k, v, g, beta, reps=10)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            t_ours = float("nan")
        try:
            t_fla = time_torch(fla_chunk(q, k, v, g, beta, cu), reps=10)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            t_fla = float("nan")
        tps_o, tps_f = T / t_ours, T / t_fla
        row("kda prefill ours vs fla chunk_kda (tok/s)", f"B=1 H=96 d=128 bf16 {label}", tps_o, tps_f, tps_o / tps_f,
            ">= 1.0x", tps_o / tps_f >= 1.0)
        print(f"prefill {label}: ours {t_ours * 1e3:.2f} ms, fla {t_fla * 1e3:.2f} ms", flush=True)
        if cu is None and T <= 8192 and left() > 30:
            try:
                t_x = time_jax(xla_ref, q, k, v, g, beta, reps=3, warm=1)
                row("kda prefill XLA reference vs fla (tok/s)", f"B=1 H=96 d=128 bf16 {label}", T / t_x, tps_f,
                    (T / t_x) / tps_f, "info", None)
            except Exception:  # noqa: BLE001
                traceback.print_exc()


def copy_bandwidth():
    import torch
    n = 1 << 30  # 2 GiB bf16
    a = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    t = time_torch(lambda: b.copy_(a), reps=20)
    return 2 * a.numel() * a.element_size() / t


def bench_decode(quick):
    import torch
    bw = copy_bandwidth()
    INFO["copy_bandwidth_TBps"] = bw / 1e12
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    step = jax.jit(lambda q, k, v, g, b, pool, slots: ops.recurrent(q, k, v, g, b, pool, slot_ids=slots, backend="gpu"),
                   donate_argnums=5)
    for B in ([1, 64] if quick else [1, 64, 256]):
        if left() < 10:
            print(f"decode B={B}: skipped (budget)", flush=True)
            continue
        q, k, v, g, beta = make_inputs(1, 10 + B, B=B)
        S = B + 3
        pool = jax.random.normal(jax.random.PRNGKey(B), (S, H, D, D), jnp.float32) * 0.1
        slots = jnp.asarray(np.random.default_rng(B).permutation(S)[:B], jnp.int32)
        # correctness (pool copy kept for the reference)
        o_r, pool_r = R.recurrent_slots(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), g, beta,
                                        pool, slots)
        o, pool2 = step(q, k, v, g, beta, jnp.array(pool), slots)
        err = max(rel(o, o_r), rel(pool2[slots], pool_r[slots]))
        INFO[f"decode_B{B}_rel_rms_vs_reference"] = err
        # timing: the pool is donated and threaded through
        state = {"p": pool2}

        def one():
            o, state["p"] = step(q, k, v, g, beta, state["p"], slots)
            return o

        t_ours = time_jax(lambda: one(), reps=50, warm=5)
        bytes_rw = 2 * B * H * D * D * 4
        # fla fused_recurrent_kda on the same inputs ([B, 1, H, D], state [B, H, D, D] fp32)
        try:
            from fla.ops.kda import fused_recurrent_kda
            tq, tk, tv, tg, tb = map(to_torch, (q, k, v, g, beta))
            h0 = to_torch(pool[slots]).contiguous()
            t_fla = time_torch(lambda: fused_recurrent_kda(tq, tk, tv, tg, tb, scale=D ** -0.5, initial_state=h0,
                                                           output_final_state=True), reps=50)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            t_fla = float("nan")
        ach = bytes_rw / t_ours
        row("kda decode ours state bytes/s vs copy BW", f"B={B} H=96 d=128 fp32 state", ach / 1e12, bw / 1e12,
            ach / bw, ">= 0.80 (B>=64)" if B >= 64 else "info", (ach / bw >= 0.8 and err < 5e-3) if B >= 64 else None)
        row("kda decode ours vs fla fused_recurrent_kda (us)", f"B={B}", t_ours * 1e6, t_fla * 1e6, t_fla / t_ours,
            "info", None)
        print(f"decode B={B}: ours {t_ours * 1e6:.1f} us ({ach / 1e12:.2f} TB/s), fla {t_fla * 1e6:.1f} us, "
              f"rel err {err:.2e}", flush=True)
        del pool, state, pool2, pool_r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-prefill", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--budget", type=float, default=1e9, help="seconds: later cases are skipped, the table printed")
    ap.add_argument("--tuning", default=None, help="JSON file with a `best_tuning` dict (bench/kda_gpu_diag.py) "
                    "applied to pallas_kernels.kda.gpu_triton.TUNING before timing")
    a = ap.parse_args()
    BUDGET[0] = a.budget
    if a.tuning and os.path.exists(a.tuning):
        from pallas_kernels.kda import gpu_triton as gpu
        with open(a.tuning) as f:
            best = json.load(f).get("best_tuning", {})
        gpu.TUNING.update({k: v for k, v in best.items() if k in gpu.TUNING})
        INFO["tuning"] = dict(gpu.TUNING)
    INFO["devices"] = [str(d) for d in jax.devices()]
    INFO["jax"] = jax.__version__
    try:
        import torch
        import triton
        INFO["torch"], INFO["triton"] = torch.__version__, triton.__version__
        import fla
        INFO["fla"] = getattr(fla, "__version__", "?")
    except Exception as e:  # noqa: BLE001
        INFO["import_error"] = repr(e)
    print(json.dumps(INFO), flush=True)
    for name, fn, skip in (("prefill", bench_prefill, a.skip_prefill), ("decode", bench_decode, a.skip_decode)):
        if skip:
            continue
        try:
            fn(a.quick)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            row(f"kda {name}", "-", float("nan"), float("nan"), float("nan"), "-", False)
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "kda.json"), "w") as f:
            json.dump(dict(info=INFO, rows=ROWS), f, indent=1, default=str)
    print("\nname, shape, ours, peer, ratio, bar, pass/fail")
    for r in ROWS:
        fmt = lambda x: f"{x:.4g}" if isinstance(x, float) else str(x)
        print(", ".join(fmt(r[k]) for k in ("name", "shape", "ours", "peer", "ratio", "bar", "result")))


if __name__ == "__main__":
    main()
