#!/usr/bin/env python3
"""Context-parallel bench at the MODEL level (issue #8), for 2 H200 GPUs (nvidia-h200-x2); `--smoke` on CPU.

    python3 bench/cp.py [--smoke] [--tokens 32768,131072] [--decode-context 131072] [--decode-batch 8] [--reps 3]
                        [--budget 210]

Model: Kimi K3.1 Pro at FULL WIDTH and reduced depth, random bf16 weights — layers (KDA, MLA+DSA), both MoE:
hidden 7168; KDA 96 heads × 128 (short conv 4, lower-bound gate, full-rank output gate); MLA 96 heads, q LoRA 1536,
latent 512 + rope 64, output gate; DSA indexer 32 × 128, top-k 2048; latent MoE 3584 → 3072 with 2 shared experts,
SiTU, AttnRes. Reduced: 2 layers, 16 routed experts top-4 (instead of 896 top-16), a 1024-id vocabulary (the
prefill computes only the last token's logits anyway). `--layers` / `--experts` / `--topk-experts` change that.

1. Prefill TTFT, one prompt, `sharding.context_parallel.prefill(model, ids, mesh, mode=...)` (run after decode;
   each prompt length's two programs are compiled first, the one with the larger temp buffer runs first, and a
   program is skipped, as a FAIL row, if XLA's memory need exceeds the free memory or its temp buffer — one
   allocation — exceeds 0.8 × the largest allocation the allocator can still make; the previous row's programs
   are released first):
   token split (tokens over the 2 devices; KDA shard transitions + prefix, conv halo, latent / index-key
   all-gather) vs head split (the 2 devices as one tensor-parallel group). Both checked against each other first.
2. Decode, B sequences at `--decode-context` cached tokens (a synthetic, identical cache for both):
   DCP2 (cache split by tokens, local top-k, (score, position) merge, lse merge) vs TP2 (cache replicated, heads
   split), the same sparse top-k algorithm; checked against each other first. Tokens/s = B / step time.
   KV capacity: tokens of MLA cache (latent + index key, every MLA layer) per GB on one device, measured from the
   arrays. Per-step communication: `decode_comm_bytes_per_step` vs the naive all-gather of the cached rows (and,
   in the note, of full score rows).
3. Full K3.1 Pro capacity from `kimi_jax.plan` (TP vs DCP, 2 and 8 devices), for reference.
Prints `name, shape, ours, peer, ratio, bar, pass/fail` last (ours = token split / DCP, peer = head split / TP);
JSON to $OUT/cp.json when OUT is set.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _early_smoke_env():
    """Before jax is imported: `--smoke` runs on CPU with 2 fake devices."""
    if "--smoke" in sys.argv:
        os.environ["JAX_PLATFORMS"] = "cpu"
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=2").strip()


_early_smoke_env()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from kimi_jax.config import get_preset  # noqa: E402
from kimi_jax.model import Model  # noqa: E402
from kimi_jax.modules.decoder import KimiForCausalLM, ModelCache  # noqa: E402
from sharding import make_mesh  # noqa: E402
from kimi_jax import parallel as mc  # noqa: E402

ROWS = []


def bench_config(args):
    if args.smoke:
        base = get_preset("tiny")
        return base.replace(layer_kinds=tuple(args.layers), dense_layers=(), attn_res_block_size=2)
    full = get_preset("kimi-k3.1-pro")
    return full.replace(vocab_size=1024, layer_kinds=tuple(args.layers), dense_layers=(),
                        moe=dataclasses.replace(full.moe, num_experts=args.experts, top_k=args.topk_experts),
                        bos_token_id=1000, eos_token_id=1002, pad_token_id=1023, vision=None)


def build_model(cfg, dtype):
    return Model(KimiForCausalLM(cfg, rngs=nnx.Rngs(0), dtype=dtype), dtype)


def time_fn(fn, reps, warm=1):
    for _ in range(warm):
        jax.block_until_ready(fn())
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def rel_rms(a, b):
    a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2) / max(np.mean(b ** 2), 1e-30)))


def row(name, shape, ours, peer, ratio, bar, ok, note=""):
    ROWS.append(dict(name=name, shape=shape, ours=ours, peer=peer, ratio=ratio, bar=bar,
                     result="info" if ok is None else ("pass" if ok else "FAIL"), note=note))


def _mem(dev):
    """Allocator view of `dev` (None where the backend reports no memory stats, e.g. CPU): free = bytes the
    allocator may still hand out in total; block = the largest single allocation it can still make. XLA's BFC
    allocator (on GPU, growing on demand with XLA_PYTHON_CLIENT_PREALLOCATE=false) keeps freed regions: a program's
    temp buffer is ONE allocation, so it must fit either a free chunk of a region already held (largest_free_block)
    or a new region (bytes_limit − pool_bytes) — free memory scattered over earlier rows' regions does not count."""
    try:
        st = dev.memory_stats()
    except Exception:  # noqa: BLE001
        return None
    if not st or "bytes_limit" not in st:
        return None
    limit, used = int(st["bytes_limit"]), int(st.get("bytes_in_use", 0))
    free = limit - used
    pool = st.get("pool_bytes", st.get("bytes_reserved"))
    if pool is None:
        block = free
    else:
        block = min(free, max(int(st.get("largest_free_block_bytes", 0)), limit - int(pool)))
    return dict(free=free, block=block, limit=limit, in_use=used, pool=None if pool is None else int(pool))


def _mem_all(mesh):
    """The tightest `_mem` over the mesh's devices (None on CPU)."""
    ms = [m for m in map(_mem, mesh.devices.flat) if m is not None]
    if not ms:
        return None
    return dict(free=min(m["free"] for m in ms), block=min(m["block"] for m in ms), limit=min(m["limit"] for m in ms),
                pool=max((m["pool"] or 0) for m in ms))


def _release(model):
    """Drop what an earlier prefill row left alive: its compiled programs (the jitted prefill functions cached on
    the model and jax's compilation caches) and any device buffers only reachable from garbage. The placed
    parameters stay."""
    store = model.__dict__.get("_context_parallel", {})
    for k in [k for k in store if k and k[0] in ("token", "head") and not (k[0] == "head" and k[2] == "decode")]:
        del store[k]
    jax.clear_caches()
    gc.collect()


def fail_row(name, shape, note, skipped=False):
    ROWS.append(dict(name=name, shape=shape, ours=float("nan"), peer=float("nan"), ratio=float("nan"), bar="",
                     result="skipped" if skipped else "FAIL", note=note))
    print(f"  {name} {shape}: {'skipped' if skipped else 'FAIL'}: {note}", flush=True)


def bench_prefill(model, mesh, tokens, args, info, budget):
    tol = 1e-4 if args.smoke else 5e-2
    name = "prefill TTFT (ms)"
    for T in tokens:
        shape = f"T={T}, B=1, {len(model.config.layer_kinds)} layers"
        ids = np.random.RandomState(T).randint(0, model.config.vocab_size - 2, (1, T))
        out, times, why, plans = {}, {}, None, {}
        _release(model)  # the previous row's programs and buffers must not hold memory this row needs
        for mode in ("token", "head"):  # compile both first (nothing is allocated); run the larger program first
            if budget.left() <= 0:
                why = ("skipped: budget", True)
                break
            try:
                t0 = time.perf_counter()
                plans[mode] = mc.prefill_plan(model, ids.shape, mesh, mode=mode, logits="last",
                                              max_chunk_bytes=args.chunk_mb << 20)
                info[f"prefill_{mode}_{T}_compile_s"] = time.perf_counter() - t0
                info[f"prefill_{mode}_{T}_memory"] = dict(plans[mode].memory, new_bytes=plans[mode].new_bytes)
                print(f"  prefill {mode} T={T}: compiled in {info[f'prefill_{mode}_{T}_compile_s']:.1f} s, needs "
                      f"{plans[mode].new_bytes / 2**30:.2f} GiB/device (temp {plans[mode].memory['temp'] / 2**30:.2f})",
                      flush=True)
            except Exception as e:  # noqa: BLE001
                why = (f"{mode} split: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}", False)
                break
        for mode in sorted(plans, key=lambda m: -plans[m].memory["temp"]) if why is None else ():
            if budget.left() <= 0:
                why = ("skipped: budget", True)
                break
            plan = plans[mode]
            try:
                gc.collect()
                mem = _mem_all(mesh)  # read just before the run, after the previous mode's buffers are gone
                need, temp = plan.new_bytes, plan.memory["temp"]
                if mem is not None:
                    info[f"prefill_{mode}_{T}_free_before"] = mem
                    print(f"  prefill {mode} T={T}: free {mem['free'] / 2**30:.2f} GiB, largest allocation possible "
                          f"{mem['block'] / 2**30:.2f} GiB (limit {mem['limit'] / 2**30:.2f}, allocator pool "
                          f"{mem['pool'] / 2**30:.2f})", flush=True)
                    # an OOM inside a collective hangs the other device: skip what would not fit, counting the temp
                    # buffer as one contiguous allocation (BFC), with headroom
                    if need > 0.92 * mem["free"] or temp > 0.8 * mem["block"]:
                        why = (f"{mode} split needs {need / 2**30:.1f} GiB/device with one {temp / 2**30:.1f} GiB "
                               f"temp buffer; {mem['free'] / 2**30:.1f} GiB free, largest possible allocation "
                               f"{mem['block'] / 2**30:.1f} GiB (not run)", False)
                        break
                run = lambda: plan.run(ids)[0]
                t0 = time.perf_counter()
                out[mode] = np.asarray(jax.block_until_ready(run()))
                info[f"prefill_{mode}_{T}_first_call_s"] = time.perf_counter() - t0
                times[mode] = time_fn(run, args.reps if T < 65536 else max(1, args.reps - 1), warm=0)
                print(f"  prefill {mode} T={T}: {times[mode] * 1e3:.1f} ms", flush=True)
                del run
            except Exception as e:  # noqa: BLE001  (an OOM / compile error becomes a FAIL row)
                why = (f"{mode} split: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}", False)
                break
        del plans
        if why is not None:
            fail_row(name, shape, why[0], skipped=why[1])
            continue
        err = rel_rms(out["token"], out["head"])
        same = bool((out["token"].argmax(-1) == out["head"].argmax(-1)).all())
        info[f"prefill_{T}_token_vs_head_rel_rms"] = err
        ok_eq = err <= tol
        # on CPU (--smoke) only the agreement decides; the speed bar is for the GPUs
        result = (ok_eq and times["head"] > times["token"]) if not args.smoke else (None if ok_eq else False)
        row(name, shape, times["token"] * 1e3, times["head"] * 1e3, times["head"] / times["token"],
            "ratio > 1 (token faster)", result,
            f"last-token logits token vs head rel {err:.1e}{'' if same else ' (argmax differs)'}")


class Budget:
    def __init__(self, seconds, t0):
        self.seconds, self.t0 = seconds, t0

    def left(self):
        return float("inf") if not self.seconds else self.seconds - (time.perf_counter() - self.t0)


def synthetic_cache(model, B, S, mesh, specs, seed=0):
    """A cache as if S−1 tokens had been prefilled (random latent rows / index keys / KDA states), placed by
    `specs`; identical values for any placement (same PRNG key)."""
    cfg, dtype = model.config, model.dtype
    shard = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))

    def make():
        c = ModelCache.zeros(cfg, B, S, dtype)
        keys = iter(jax.random.split(jax.random.PRNGKey(seed), 64))
        rnd = lambda a, s=1.0: (jax.random.normal(next(keys), a.shape, jnp.float32) * s).astype(a.dtype)
        layers = tuple(jax.tree.map(lambda a: rnd(a, 0.05 if a.ndim == 4 else 1.0), l) for l in c.layers)
        return ModelCache(jnp.full((B,), S - 1, jnp.int32).at[0].set(S - 1 - S // 3), layers)

    return jax.jit(make, out_shardings=shard)()


def cache_bytes_per_device(cache, cfg):
    """MLA cache bytes (latent + index keys, all MLA layers) held by the first device."""
    dev = jax.devices()[0]
    tot = 0
    for i in cfg.mla_layers:
        for a in cache.layers[i]:
            tot += sum(s.data.nbytes for s in a.addressable_shards if s.device == dev)
    return tot


def bench_decode(model, mesh, S, B, args, info):
    cfg = model.config
    n = mesh.shape["context"]
    tol = 1e-4 if args.smoke else 5e-2
    B_ = B
    dcp_specs = mc._cache_specs(cfg, None, "context", True)
    hm = mc._head_mesh(mesh, "context")
    tp_specs = mc._cache_specs(cfg, None, None, False)
    tok = jnp.asarray(np.random.RandomState(1).randint(0, cfg.vocab_size - 2, (B_,)), jnp.int32)
    res = {}
    for mode, m_, specs in (("dcp", mesh, dcp_specs), ("tp", hm, tp_specs)):
        cache = synthetic_cache(model, B_, S, m_, specs)
        per_dev = cache_bytes_per_device(cache, cfg)
        logits, cache = mc.decode_step(model, cache, tok, mesh, mode=mode)
        first = np.asarray(logits)
        state = {"c": cache}

        def step():
            lg, state["c"] = mc.decode_step(model, state["c"], tok, mesh, mode=mode)
            return lg

        res[mode] = dict(t=time_fn(step, args.reps * 4, warm=1), logits=first, bytes=per_dev)
        print(f"  decode {mode}: {res[mode]['t'] * 1e3:.2f} ms/step", flush=True)
        del cache, state
    err = rel_rms(res["dcp"]["logits"], res["tp"]["logits"])
    info["decode_dcp_vs_tp_rel_rms"] = err
    t_d, t_t = res["dcp"]["t"], res["tp"]["t"]
    result = (t_t >= t_d and err <= tol) if not args.smoke else (None if err <= tol else False)
    row("decode tokens/s", f"B={B_}, ctx={S}", B_ / t_d, B_ / t_t, t_t / t_d, "ratio >= 1 (DCP2 not slower)",
        result, f"DCP{n} vs TP{n} step logits rel {err:.1e}")
    cap_d = B_ * S / res["dcp"]["bytes"] * 1e9
    cap_t = B_ * S / res["tp"]["bytes"] * 1e9
    row("KV capacity (tokens / GB / device)", f"{len(cfg.mla_layers)} MLA layers, {jnp.dtype(model.dtype).name}",
        cap_d, cap_t, cap_d / cap_t, f">= {0.95 * n:.1f}x", cap_d / cap_t >= 0.95 * n,
        f"per device: DCP {res['dcp']['bytes'] / 1e9:.2f} GB vs TP {res['tp']['bytes'] / 1e9:.2f} GB")
    cb = mc.decode_comm_bytes_per_step(cfg, n=n, batch=B_, seq_len=S, kv_dtype="bf16", index_dtype="bf16")
    info["decode_comm_bytes"] = cb
    row("decode comm recv / device / step (KB)", f"B={B_}, ctx={S}", cb["recv_dcp"] / 1e3,
        cb["recv_naive_latents"] / 1e3, cb["recv_dcp"] / cb["recv_naive_latents"], "<= 0.1x naive all-gather",
        cb["recv_dcp"] <= 0.1 * cb["recv_naive_latents"],
        f"peer = all-gather of the cached rows; naive score-row all-gather {cb['recv_naive_scores'] / 1e3:.1f} KB")
    from kimi_jax.config import get_preset as gp

    k31 = mc.decode_comm_bytes_per_step(gp("kimi-k3.1-pro"), n=8, batch=1, seq_len=1 << 20)
    info["decode_comm_bytes_k31_dcp8_1m"] = k31
    row("K3.1 DCP8 1M ctx comm recv / device / step (KB)", "B=1, fp8, 24 MLA layers", k31["recv_dcp"] / 1e3,
        k31["recv_naive_scores"] / 1e3, k31["recv_dcp"] / k31["recv_naive_scores"], "~0.1x (vLLM: a tenth)",
        None, f"naive latent all-gather {k31['recv_naive_latents'] / 1e9:.1f} GB")


def capacity(args, info):
    from kimi_jax.plan import plan

    cfg = get_preset("kimi-k3.1-pro")
    out = []
    for tp, hbm in ((2, 141.0), (8, 141.0), (8, 288.0)):
        for kv_dtype, idx_dtype in (("fp8", "fp8"), ("nvfp4", "mxfp4")):
            r = {d: plan(cfg, kv_dtype=kv_dtype, index_dtype=idx_dtype, mesh=(tp, 1), dcp=d, hbm_gb=hbm)
                 for d in (1, tp)}
            a, b = r[tp], r[1]
            out.append(dict(devices=tp, hbm_gb=hbm, kv=kv_dtype, index=idx_dtype, fits=a["fits"],
                            tokens_dcp=a["max_cached_tokens"], tokens_tp=b["max_cached_tokens"]))
            if a["fits"]:
                row("K3.1 plan: cached tokens", f"{tp}x{hbm:.0f}GB {kv_dtype}+{idx_dtype}", a["max_cached_tokens"],
                    b["max_cached_tokens"], a["max_cached_tokens"] / max(1, b["max_cached_tokens"]), "info", None,
                    f"1M-token seqs DCP{tp} {a['max_1m_sequences']} vs TP {b['max_1m_sequences']}")
    info["capacity_k31_plan"] = out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny widths on CPU with 2 fake devices, fp32")
    ap.add_argument("--tokens", default=None, help="prefill lengths (default 32768,131072; smoke 64)")
    ap.add_argument("--layers", default="kda,mla", help="layer kinds of the reduced model (default kda,mla)")
    ap.add_argument("--experts", type=int, default=16, help="routed experts (default 16; K3.1 has 896)")
    ap.add_argument("--topk-experts", type=int, default=4, help="experts per token (default 4; K3.1 has 16)")
    ap.add_argument("--decode-context", type=int, default=None, help="cached tokens per sequence (default 131072)")
    ap.add_argument("--decode-batch", type=int, default=None, help="sequences per decode step (default 8)")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions (median; default 3, smoke 1)")
    ap.add_argument("--chunk-mb", type=int, default=None, help="MLA/indexer per-query-chunk buffer (default 4096)")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: prefill,decode,capacity")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds (default 210; smoke 0 = none): parts / prefill modes that would start after it are "
                         "skipped (rows 'skipped: budget'); the table and cp.json always come out")
    ap.add_argument("--grace", type=float, default=60.0,
                    help="a watchdog ends the run budget + grace seconds after start (table and cp.json first)")
    args = ap.parse_args(argv)
    args.layers = [s.strip() for s in args.layers.split(",")]
    tokens = [int(t) for t in (args.tokens or ("64" if args.smoke else "32768,131072")).split(",")]
    S = args.decode_context or (96 if args.smoke else 131072)
    B = args.decode_batch or (2 if args.smoke else 8)
    args.reps = args.reps or (1 if args.smoke else 3)
    args.chunk_mb = args.chunk_mb or (64 if args.smoke else 4096)
    skip = set(filter(None, args.skip.split(",")))
    if args.budget is None:
        args.budget = 0.0 if args.smoke else 210.0

    devs = jax.devices()
    if len(devs) < 2:
        print(f"needs 2 devices, found {len(devs)} ({devs[0].platform}); use --smoke on CPU", file=sys.stderr)
        return 2
    mesh = make_mesh("context=2", devices=devs[:2])
    dtype = jnp.float32 if args.smoke else jnp.bfloat16
    cfg = bench_config(args)
    t0 = time.perf_counter()
    model = build_model(cfg, dtype)
    info = {"jax": jax.__version__, "devices": [str(d) for d in devs[:2]], "platform": devs[0].platform,
            "smoke": args.smoke, "dtype": jnp.dtype(dtype).name, "layers": args.layers,
            "experts": [cfg.moe.num_experts, cfg.moe.top_k], "hidden": cfg.hidden_size,
            "build_s": time.perf_counter() - t0}
    print("cp bench:", json.dumps(info), flush=True)
    budget = Budget(args.budget, t0)
    done = {"flag": False}

    def finish(note=None):
        if done["flag"]:
            return 0
        done["flag"] = True
        if note:
            info["note"] = note
        ok = True
        print(f"\n{'name':46s} {'shape':30s} {'ours':>12s} {'peer':>12s} {'ratio':>7s}  {'bar':28s} {'pass/fail':9s} "
              f"note", flush=True)
        for r in list(ROWS):
            ok &= r["result"] != "FAIL"
            print(f"{r['name']:46s} {r['shape']:30s} {r['ours']:12.4g} {r['peer']:12.4g} {r['ratio']:7.3f}  "
                  f"{r['bar']:28s} {r['result']:9s} {r['note']}", flush=True)
        info["rows"] = ROWS
        info["total_s"] = time.perf_counter() - t0
        print(f"total {info['total_s']:.1f} s (budget {args.budget or 'none'})", flush=True)
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "cp.json"), "w") as fh:
                json.dump(info, fh, indent=1, default=str)
        return 0 if ok else 1

    if args.budget:  # a hang (e.g. one device stuck in a collective) still prints the table and writes cp.json
        import threading

        def watchdog():
            fail_row("watchdog", "", f"still running {args.budget + args.grace:.0f} s after start: aborted")
            finish("aborted by the watchdog")
            os._exit(3)

        timer = threading.Timer(args.budget + args.grace, watchdog)
        timer.daemon = True
        timer.start()

    def part(label, fn):
        if budget.left() <= 0:
            fail_row(label, "", "skipped: budget", skipped=True)
            return
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            fail_row(label, "", f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")

    if "decode" not in skip:  # first: the decode rows are cheap and must not be lost to a prefill failure
        part("decode", lambda: bench_decode(model, mesh, S, B, args, info))
    if "prefill" not in skip:
        bench_prefill(model, mesh, tokens, args, info, budget)
    if "capacity" not in skip:
        try:
            capacity(args, info)
        except Exception as e:  # noqa: BLE001
            fail_row("K3.1 plan", "", f"{type(e).__name__}: {e}")
    return finish()


if __name__ == "__main__":
    sys.exit(main())
