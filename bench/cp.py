#!/usr/bin/env python3
"""Context-parallel bench (issue #8), written for 2 H200 GPUs (nvidia-h200-x2); `--smoke` runs tiny shapes on CPU.

    python3 bench/cp.py [--smoke] [--tokens 32768,131072] [--decode-context 131072] [--decode-batch 8] [--reps 5]

1. Prefill of a reduced-depth, full-width K3.1-shaped block (1 KDA layer + 1 MLA+DSA layer per pair, `--pairs`):
   hidden 7168; KDA 96 heads × 128 (q/k/v projections, short conv 4, low-rank forget gate with the lower-bound gate
   fused into the op, β, per-head RMS norm, full-rank output gate, o_proj); MLA 96 heads, q LoRA 1536, latent 512 +
   rope 64 (absorbed W_UK / W_UV), output gate; DSA indexer 32 × 128, top-k 2048. No MoE, no AttnRes.
   token split : prompt split by tokens over the 2 devices, weights replicated (KDA shard transitions + prefix,
                 conv halo, latent/index-key all-gather) — `sharding.context_parallel`.
   head split  : activations replicated, heads split (KDA, MLA heads; the indexer and the latent projection run on
                 both), one all-reduce of each layer's output.
   Both are checked against each other before timing, at 32K and 128K tokens.
2. Decode attention of one MLA+DSA layer, B sequences at `--decode-context` cached tokens: DCP2 (cache split by
   tokens, local top-k candidates exchanged, lse merge) vs TP2 (cache replicated, heads split), checked equal
   (same selected sets) before timing. Per-step communication from `decode_comm_bytes`.
3. Cache capacity from `kimi_jax.plan` (the engine's cache layout): TP vs DCP on 2 and 8 devices, FP8 and
   NVFP4 + MXFP4.
Prints a table `name, shape, token/DCP, head/TP, ratio` last; JSON to $OUT/cp.json when OUT is set.
Not run on a device yet (the lead decides when).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _early_smoke_env():
    """Before jax is imported: `--smoke` runs on CPU with 2 fake devices (the KDA op is then the token recurrence,
    see `context_parallel.resolve_kda_backend`)."""
    if "--smoke" in sys.argv:
        os.environ["JAX_PLATFORMS"] = "cpu"
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=2").strip()


_early_smoke_env()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from pallas_kernels.kda import reference as kda_ref  # noqa: E402
from sharding import context_parallel as cp  # noqa: E402

AX = cp.CONTEXT
ROWS = []


@dataclasses.dataclass(frozen=True)
class Shapes:
    hidden: int = 7168
    kda_heads: int = 96
    kda_dim: int = 128
    conv: int = 4
    mla_heads: int = 96
    q_lora: int = 1536
    kv_lora: int = 512
    rope: int = 64
    nope: int = 128
    v_head: int = 128
    idx_heads: int = 32
    idx_dim: int = 128
    topk: int = 2048
    lower_bound: float = -5.0


SMOKE = Shapes(hidden=64, kda_heads=4, kda_dim=16, mla_heads=4, q_lora=32, kv_lora=16, rope=8, nope=8, v_head=8,
               idx_heads=2, idx_dim=8, topk=16)


# ----------------------------------------------------------------------------------------------------------------
# parameters and the block
# ----------------------------------------------------------------------------------------------------------------

def init_params(s: Shapes, dtype, seed=0):
    Pk = s.kda_heads * s.kda_dim
    Hm, qd = s.mla_heads, s.nope + s.rope
    shapes = {
        # KDA
        "wq": (s.hidden, Pk), "wk": (s.hidden, Pk), "wv": (s.hidden, Pk),
        "conv_q": (s.conv, Pk), "conv_k": (s.conv, Pk), "conv_v": (s.conv, Pk),
        "wfa": (s.hidden, s.kda_dim), "wfb": (s.kda_dim, Pk), "wb": (s.hidden, s.kda_heads),
        "wg_kda": (s.hidden, Pk), "wo_kda": (Pk, s.hidden),
        # MLA + indexer
        "wqa": (s.hidden, s.q_lora), "wqb": (s.q_lora, Hm * qd), "wkva": (s.hidden, s.kv_lora + s.rope),
        "w_uk": (Hm, s.nope, s.kv_lora), "w_uv": (Hm, s.kv_lora, s.v_head),
        "wg_mla": (s.hidden, Hm * s.v_head), "wo_mla": (Hm * s.v_head, s.hidden),
        "wiq": (s.q_lora, s.idx_heads * s.idx_dim), "wik": (s.hidden, s.idx_dim), "wiw": (s.hidden, s.idx_heads),
    }
    keys = jax.random.split(jax.random.PRNGKey(seed), len(shapes) + 2)
    p = {}
    for key, (name, shp) in zip(keys, shapes.items()):
        fan_in = shp[-2] if len(shp) >= 2 and not name.startswith("conv") else shp[0]
        p[name] = (jax.random.normal(key, shp, jnp.float32) * fan_in ** -0.5).astype(dtype)
    p["A_log"] = jax.random.uniform(keys[-2], (s.kda_heads,), jnp.float32, -1.0, 1.0)
    p["dt_bias"] = jax.random.normal(keys[-1], (Pk,), jnp.float32) * 0.1
    return p


def head_specs(p):
    """Partition of each parameter under the head split (token split replicates everything)."""
    col = {"wq", "wk", "wv", "conv_q", "conv_k", "conv_v", "wfb", "wb", "wg_kda", "wqb", "wg_mla", "A_log", "dt_bias"}
    row = {"wo_kda", "wo_mla", "w_uk", "w_uv"}
    spec = {}
    for k, a in p.items():
        if k in col:
            spec[k] = P(*([None] * (a.ndim - 1) + [AX]))
        elif k in row:
            spec[k] = P(AX)
        else:
            spec[k] = P()
    return spec


def _rms(x, eps=1e-5):
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + eps)).astype(x.dtype)


def _layernorm(x, eps=1e-5):
    xf = x.astype(jnp.float32)
    xf = xf - jnp.mean(xf, -1, keepdims=True)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + eps)).astype(x.dtype)


def kda_layer(p, x, s: Shapes, mode: str, backend: str):
    B, T, _ = x.shape
    dt = x.dtype
    h = _rms(x)
    Hl = p["wb"].shape[1]  # local heads
    d = s.kda_dim

    def proj_conv(w, cw):
        y = h @ w
        if mode == "token":
            y, _ = cp.conv_token_split_shard(y, cw, axis=AX)
        else:
            y, _ = kda_ref.causal_conv(y, cw)
        return jax.nn.silu(y).reshape(B, T, Hl, d)

    q = kda_ref.l2norm(proj_conv(p["wq"], p["conv_q"])).astype(dt)
    k = kda_ref.l2norm(proj_conv(p["wk"], p["conv_k"])).astype(dt)
    v = proj_conv(p["wv"], p["conv_v"]).astype(dt)
    f = ((h @ p["wfa"]) @ p["wfb"]).astype(jnp.float32).reshape(B, T, Hl, d)
    beta = jax.nn.sigmoid((h @ p["wb"]).astype(jnp.float32))
    gk = dict(gate_form="lower_bound", A_log=p["A_log"], dt_bias=p["dt_bias"], lower_bound=s.lower_bound)
    if mode == "token":
        o, _ = cp.kda_token_split_shard(q, k, v, f, beta, None, axis=AX, backend=backend, **gk)
    else:
        o, _ = cp.kda_local_op(q, k, v, f, beta, None, backend=backend, **gk)
    o = _rms(o.astype(jnp.float32)).reshape(B, T, Hl * d) * jax.nn.sigmoid((h @ p["wg_kda"]).astype(jnp.float32))
    out = o.astype(dt) @ p["wo_kda"]
    return out if mode == "token" else jax.lax.psum(out, AX)


def mla_layer(p, x, s: Shapes, mode: str, chunk_bytes: int):
    B, T, _ = x.shape
    dt = x.dtype
    h = _rms(x)
    Hl = p["w_uk"].shape[0]
    cq = _rms(h @ p["wqa"])
    q = (cq @ p["wqb"]).reshape(B, T, Hl, s.nope + s.rope)
    q_lat = jnp.einsum("bthn,hnr->bthr", q[..., :s.nope], p["w_uk"], preferred_element_type=jnp.float32)
    q_abs = jnp.concatenate([q_lat.astype(dt), q[..., s.nope:]], axis=-1)
    ckv = h @ p["wkva"]
    kv = jnp.concatenate([_rms(ckv[..., :s.kv_lora]), ckv[..., s.kv_lora:]], axis=-1)
    qi = (cq @ p["wiq"]).reshape(B, T, s.idx_heads, s.idx_dim)
    ki = _layernorm(h @ p["wik"])
    w = (h @ p["wiw"]).astype(jnp.float32) * (s.idx_heads ** -0.5 * s.idx_dim ** -0.5)
    kw = dict(scale=(s.nope + s.rope) ** -0.5, value_dim=s.kv_lora, topk=s.topk, max_chunk_bytes=chunk_bytes)
    if mode == "token":
        o_lat, _ = cp.mla_token_split_shard(q_abs, kv, qi, ki, w, axis=AX, **kw)
    else:
        o_lat, _ = cp.mla_head_split_shard(q_abs, kv, qi, ki, w, **kw)
    o = jnp.einsum("bthr,hrv->bthv", o_lat.astype(dt), p["w_uv"]).reshape(B, T, Hl * s.v_head)
    o = o * jax.nn.sigmoid(h @ p["wg_mla"])
    out = o @ p["wo_mla"]
    return out if mode == "token" else jax.lax.psum(out, AX)


def make_block(mesh, p, s: Shapes, mode: str, pairs: int, backend: str, chunk_bytes: int):
    def body(p, x):
        for _ in range(pairs):
            x = x + kda_layer(p, x, s, mode, backend)
            x = x + mla_layer(p, x, s, mode, chunk_bytes)
        return x

    pspec = {k: P() for k in p} if mode == "token" else head_specs(p)
    xspec = P(None, AX) if mode == "token" else P()
    f = jax.jit(cp._shard_map(body, mesh, (pspec, xspec), xspec))
    place = lambda: ({k: jax.device_put(a, NamedSharding(mesh, pspec[k])) for k, a in p.items()}, xspec)
    return f, place


# ----------------------------------------------------------------------------------------------------------------
# timing helpers
# ----------------------------------------------------------------------------------------------------------------

def time_fn(fn, *args, reps=5, warm=1):
    for _ in range(warm):
        jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def rel(a, b):
    a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2) / max(np.mean(b ** 2), 1e-30)))


def row(name, shape, a, b, ratio, note=""):
    ROWS.append(dict(name=name, shape=shape, a=a, b=b, ratio=ratio, note=note))


# ----------------------------------------------------------------------------------------------------------------
# the three parts
# ----------------------------------------------------------------------------------------------------------------

def bench_prefill(mesh, s, tokens, dtype, args, info):
    p = init_params(s, dtype)
    bar = 1e-4 if dtype == jnp.float32 else 3e-2
    for T in tokens:
        x = (jax.random.normal(jax.random.PRNGKey(T), (1, T, s.hidden), jnp.float32)).astype(dtype)
        outs, times = {}, {}
        for mode in ("token", "head"):
            f, place = make_block(mesh, p, s, mode, args.pairs, args.backend, args.chunk_mb << 20)
            pp, xspec = place()
            xx = jax.device_put(x, NamedSharding(mesh, xspec))
            t0 = time.perf_counter()
            outs[mode] = jax.block_until_ready(f(pp, xx))
            info[f"prefill_{mode}_{T}_first_call_s"] = time.perf_counter() - t0
            times[mode] = time_fn(f, pp, xx, reps=args.reps)
            del pp, xx
        err = rel(outs["token"] - x, outs["head"] - x)
        info[f"prefill_{T}_token_vs_head_rel_rms"] = err
        ok = err <= bar
        row("prefill block (ms)", f"T={T}, {args.pairs} KDA+MLA pair(s)", times["token"] * 1e3, times["head"] * 1e3,
            times["head"] / times["token"], f"token/head agree {err:.1e} {'ok' if ok else 'FAIL'}")
        row("prefill tokens/s", f"T={T}", T / times["token"], T / times["head"], times["head"] / times["token"])
        comm = cp.prefill_comm_bytes(n=2, batch=1, tokens=T, kda_heads=s.kda_heads, dk=s.kda_dim, dv=s.kda_dim,
                                     hidden=s.hidden, latent_row_bytes=jnp.dtype(dtype).itemsize
                                     * (s.kv_lora + s.rope), index_row_bytes=jnp.dtype(dtype).itemsize * s.idx_dim,
                                     act_bytes=jnp.dtype(dtype).itemsize)
        row("prefill comm / device / pair (MB)", f"T={T}", (comm["token_kda"] + comm["token_mla"]) / 1e6,
            (comm["head_kda"] + comm["head_mla"]) / 1e6,
            (comm["head_kda"] + comm["head_mla"]) / max(1, comm["token_kda"] + comm["token_mla"]))
        del outs


def bench_decode(mesh, s, ctx, batch, dtype, args, info):
    n = mesh.shape[AX]
    c = s.kv_lora + s.rope
    ks = jax.random.split(jax.random.PRNGKey(1), 6)
    q = jax.random.normal(ks[0], (batch, s.mla_heads, c), jnp.float32).astype(dtype)
    kv = jax.random.normal(ks[1], (batch, ctx, c), jnp.float32).astype(dtype)
    qi = jax.random.normal(ks[2], (batch, s.idx_heads, s.idx_dim), jnp.float32).astype(dtype)
    ki = jax.random.normal(ks[3], (batch, ctx, s.idx_dim), jnp.float32).astype(dtype)
    w = jax.random.normal(ks[4], (batch, s.idx_heads), jnp.float32) * (s.idx_heads * s.idx_dim) ** -0.5
    lens = jnp.full((batch,), ctx, jnp.int32).at[0].set(ctx - ctx // 3)  # one shorter sequence
    kw = dict(scale=(s.nope + s.rope) ** -0.5, value_dim=s.kv_lora, topk=s.topk)
    rep = NamedSharding(mesh, P())
    kv_d = jax.device_put(cp.dcp_place(kv, n, args.layout), NamedSharding(mesh, P(None, AX)))
    ki_d = jax.device_put(cp.dcp_place(ki, n, args.layout), NamedSharding(mesh, P(None, AX)))
    q_r, qi_r, w_r, lens_r = (jax.device_put(a, rep) for a in (q, qi, w, lens))
    dcp_fn = lambda: cp.dcp_decode(q_r, kv_d, lens_r, qi_r, ki_d, w_r, mesh=mesh, layout=args.layout, **kw)
    o_d, lse_d, sel_d = jax.block_until_ready(dcp_fn())
    kv_r, ki_r = jax.device_put(kv, rep), jax.device_put(ki, rep)
    q_h = jax.device_put(q, NamedSharding(mesh, P(None, AX)))
    tp_fn = lambda: cp.head_split_decode(q_h, kv_r, lens_r, qi_r, ki_r, w_r, mesh=mesh, **kw)
    o_t, lse_t, sel_t = jax.block_until_ready(tp_fn())
    differ = int((np.sort(np.asarray(sel_d), -1) != np.sort(np.asarray(sel_t), -1)).any(-1).sum())
    err = rel(o_d, o_t)
    info["decode_sequences_with_different_sets"] = differ  # only near-ties at the k-th score can differ
    info["decode_dcp_vs_tp_rel_rms"] = err
    t_tp = time_fn(tp_fn, reps=args.reps)
    t_dcp = time_fn(dcp_fn, reps=args.reps)
    ok = err <= (1e-4 if dtype == jnp.float32 else 3e-2) and (differ == 0 or dtype != jnp.float32)
    row("decode attention step (ms)", f"B={batch}, ctx={ctx}, 1 layer", t_dcp * 1e3, t_tp * 1e3, t_tp / t_dcp,
        f"DCP{n} vs TP{n}: top-k sets differ in {differ}/{batch} seqs, o {err:.1e} {'ok' if ok else 'FAIL'}")
    isz = jnp.dtype(dtype).itemsize
    cb = cp.decode_comm_bytes(n=n, batch=batch, heads=s.mla_heads, value_dim=s.kv_lora, seq_len=ctx, topk=s.topk,
                              latent_row_bytes=c * isz, index_row_bytes=s.idx_dim * isz)
    info["decode_comm_bytes"] = cb
    row("decode comm recv / device / step (KB)", f"B={batch}, ctx={ctx}", cb["recv_dcp"] / 1e3, 0.0, float("nan"),
        f"naive score rows {cb['recv_naive_scores'] / 1e3:.1f} KB, "
        f"naive latents {cb['recv_naive_latents'] / 1e6:.1f} MB")
    k31 = cp.decode_comm_bytes(n=8, batch=1, heads=96, value_dim=512, seq_len=1 << 20, topk=2048)
    info["decode_comm_bytes_k31_dcp8_1m"] = k31
    row("K3.1 DCP8 1M ctx comm recv / device / layer (KB)", "B=1, fp8 rows", k31["recv_dcp"] / 1e3, 0.0,
        float("nan"), f"naive scores {k31['recv_naive_scores'] / 1e3:.0f} KB, naive latents "
                      f"{k31['recv_naive_latents'] / 1e6:.0f} MB")
    return ok


def capacity(args, info):
    from kimi_jax.config import load_config
    from kimi_jax.plan import plan

    cfg = load_config(args.capacity_config)
    out = []
    for tp, hbm in ((2, args.hbm_gb), (8, args.hbm_gb), (8, 288.0)):
        for kv_dtype, idx_dtype in (("fp8", "fp8"), ("nvfp4", "mxfp4")):
            try:
                r = {d: plan(cfg, kv_dtype=kv_dtype, index_dtype=idx_dtype, mesh=(tp, 1), dcp=d, hbm_gb=hbm)
                     for d in (1, tp)}
            except ValueError as e:  # e.g. a tiny config whose dims a format cannot pack
                out.append(dict(devices=tp, kv=kv_dtype, index=idx_dtype, error=str(e)))
                continue
            a, b = r[tp], r[1]
            out.append(dict(devices=tp, hbm_gb=hbm, kv=kv_dtype, index=idx_dtype, fits=a["fits"],
                            kv_bytes_per_token=a["kv_bytes_per_token"],
                            tokens_dcp=a["max_cached_tokens"], tokens_tp=b["max_cached_tokens"],
                            seq1m_dcp=a["max_1m_sequences"], seq1m_tp=b["max_1m_sequences"]))
            shape = f"{args.capacity_config} {tp}x{hbm:.0f}GB {kv_dtype}+{idx_dtype}"
            if a["fits"]:
                row("capacity: cached tokens", shape, a["max_cached_tokens"], b["max_cached_tokens"],
                    a["max_cached_tokens"] / max(1, b["max_cached_tokens"]),
                    f"1M-token seqs DCP{tp} {a['max_1m_sequences']} vs TP {b['max_1m_sequences']}")
            else:
                row("capacity: cached tokens", shape, 0, 0, float("nan"),
                    f"weights do not fit ({a['weight_bytes_per_device'] / 1e9:.0f} GB/device); per-device cache "
                    f"bytes/token DCP{tp} {a['kv_bytes_per_token'] / tp:.0f} vs TP {a['kv_bytes_per_token']}")
    info["capacity"] = out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU with 2 fake devices, fp32")
    ap.add_argument("--tokens", default=None, help="prefill lengths (default 32768,131072; smoke 64,128)")
    ap.add_argument("--pairs", type=int, default=1, help="KDA+MLA layer pairs in the block (default 1)")
    ap.add_argument("--decode-context", type=int, default=None, help="cached tokens per sequence (default 131072)")
    ap.add_argument("--decode-batch", type=int, default=None, help="sequences per decode step (default 8)")
    ap.add_argument("--layout", default="contiguous", choices=cp.LAYOUTS, help="DCP token layout")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions (median; default 5, smoke 1)")
    ap.add_argument("--backend", default="auto", choices=cp.KDA_BACKENDS,
                    help="KDA op per shard (default auto: the GPU kernel on a GPU, the token recurrence on CPU)")
    ap.add_argument("--chunk-mb", type=int, default=None, help="MLA/indexer per-query-chunk buffer (default 4096)")
    ap.add_argument("--hbm-gb", type=float, default=141.0, help="memory per device for the capacity plan")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: prefill,decode,capacity")
    args = ap.parse_args(argv)

    s = SMOKE if args.smoke else Shapes()
    dtype = jnp.float32 if args.smoke else jnp.bfloat16
    tokens = [int(t) for t in (args.tokens or ("64,128" if args.smoke else "32768,131072")).split(",")]
    args.decode_context = args.decode_context or (96 if args.smoke else 131072)
    args.decode_batch = args.decode_batch or (2 if args.smoke else 8)
    args.reps = args.reps or (1 if args.smoke else 5)
    args.chunk_mb = args.chunk_mb or (64 if args.smoke else 4096)
    args.capacity_config = "tiny" if args.smoke else "kimi-k3.1-pro"
    skip = set(filter(None, args.skip.split(",")))

    devs = jax.devices()
    if len(devs) < 2:
        print(f"needs 2 devices, found {len(devs)} ({devs[0].platform}); use --smoke on CPU", file=sys.stderr)
        return 2
    mesh = cp.make_context_mesh(2, devices=devs[:2])
    info = {"jax": jax.__version__, "devices": [str(d) for d in devs[:2]], "platform": devs[0].platform,
            "smoke": args.smoke, "shapes": dataclasses.asdict(s), "dtype": str(jnp.dtype(dtype))}
    print("cp bench:", json.dumps({k: info[k] for k in ("jax", "platform", "devices", "dtype")}), flush=True)
    ok = True
    if "prefill" not in skip:
        bench_prefill(mesh, s, tokens, dtype, args, info)
    if "decode" not in skip:
        ok &= bench_decode(mesh, s, args.decode_context, args.decode_batch, dtype, args, info)
    if "capacity" not in skip:
        capacity(args, info)

    print(f"\n{'name':48s} {'shape':40s} {'token/DCP':>14s} {'head/TP':>14s} {'ratio':>7s}  note")
    for r in ROWS:
        ok &= "FAIL" not in r["note"]
        print(f"{r['name']:48s} {r['shape']:40s} {r['a']:14.4g} {r['b']:14.4g} {r['ratio']:7.3f}  {r['note']}")
    info["rows"] = ROWS
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "cp.json"), "w") as fh:
            json.dump(info, fh, indent=1, default=str)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
