"""Sparse MLA decode on the GPU: the Mosaic GPU kernel (`pallas_kernels.mla.sparse_mgpu`) vs the Triton kernel
(`mla.sparse_gpu_triton`) at its storage preset, fp8 latent rows, latent bytes gathered per second vs copy bandwidth
(BENCHMARKS.md: ≥ 0.60). Every timed op is checked against the reference on the dequantised rows first (storage bar
5e-3).

    python3 bench/mla_mgpu.py [--contexts 32768] [--batches 32] [--heads 12] [--configs '[{}, {"splits": 4}]']

Times the whole op (q preparation, slot padding, kernel, merge) as a chain of calls on distinct selections in one
program (`_timing.device_seconds`), and the Mosaic kernel alone on prepared inputs ("kernel" rows; op minus kernel
is the XLA side and the merge). `--ops trace` runs the kernel alone with its per-CTA globaltimer stamps
(`kernel_call(trace=True)`) and prints each phase's median and max over the CTA warpgroups: where a CTA's time goes.
Prints a table and writes $OUT/mla_mgpu.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _timing import device_seconds, torch_copy_bandwidth  # noqa: E402

from kimi_jax import quant as Q  # noqa: E402
from pallas_kernels.mla import sparse, sparse_gpu_triton  # noqa: E402
from mla_trace import trace_phases  # noqa: E402
from pallas_kernels.mla import sparse_mgpu as sm  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--contexts", default="32768", help="comma-separated tokens per sequence")
ap.add_argument("--batches", default="32", help="comma-separated sequences per call")
ap.add_argument("--heads", default="12", help="comma-separated head counts (≤ 16: one TP shard of 96)")
ap.add_argument("--configs", default="[{}]", help="JSON list of MgpuSparseConfig field dicts to time")
ap.add_argument("--op-configs", default=None, help="JSON list for the whole-op rows (default: --configs)")
ap.add_argument("--no-triton", action="store_true", help="skip the Triton storage preset")
ap.add_argument("--chain", type=int, default=3,
                help="distinct selections per timing chain (≥ 2 keeps B = 32 out of the 50 MB L2; each chained "
                     "Mosaic call compiles on its own)")
ap.add_argument("--ops", default="kernel,op", help="what to time: kernel (alone), op (whole), gather (XLA reading "
                "the same rows, summed per sequence: what a plain gather of 576-byte rows reaches on this chip), "
                "trace (the kernel alone with its per-CTA globaltimer timeline: where a CTA's time goes), floor "
                "(what the chained timing costs per call by itself: an op writing the outputs' shapes from q alone)")
ARGS = ap.parse_args()
PAGE, R, ROPE, TOPK = 64, 512, 64, 2048
ROWS = []


def rel_rms(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b ** 2)))


def row(name, shape, us, tbps, bw, err):
    frac = tbps / (bw / 1e12)
    ROWS.append(dict(name=name, shape=shape, us=us, TBps=tbps, copy_TBps=bw / 1e12, fraction=frac, rel_rms=err))
    print(f"{name:42s} {shape:28s} {us:8.1f} us {tbps:6.2f} TB/s  {frac:5.3f} of copy  err {err:.1e}", flush=True)


def trace_kernel(c, q16, c2, slots, bt, pool_u8, H, shape):
    """The kernel alone with trace=True, called on each selection of the chain in turn (the rows of one are not
    in L2 when the next runs); the last call's timeline, per phase: median and max over the CTA warpgroups."""
    f = jax.jit(lambda q16, c2, slots, bt, pool_u8: sm.kernel_call(
        q16, c2, slots, bt, pool_u8, R=R, page=PAGE, config=c, H=H, layer_scale=0.5, scale=192 ** -0.5,
        trace=True)[-1])
    try:
        for i in range(2 * slots.shape[0]):
            trace = f(q16, c2, slots[i % slots.shape[0]], bt, pool_u8).block_until_ready()
    except Exception as e:  # noqa: BLE001
        print(f"trace {c}: ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)
        return
    phases = trace_phases(np.asarray(trace), trace.shape[-1] // 2 - 2)
    print(f"timeline {shape} {c}", flush=True)
    for name, (med, mx) in phases.items():
        print(f"  {name:24s} median {med:7.2f} us  max {mx:7.2f} us", flush=True)
    ROWS.append(dict(name="timeline", shape=shape, config=dataclasses.asdict(c), phases=phases))


def main():
    bw = torch_copy_bandwidth()
    print(f"jax {jax.__version__} {jax.devices()[0].device_kind}; copy {bw / 1e12:.2f} TB/s", flush=True)
    fmt = Q.LatentFormat("fp8", R, ROPE)
    configs = json.loads(ARGS.configs)
    for ctx in map(int, ARGS.contexts.split(",")):
        for B in map(int, ARGS.batches.split(",")):
            key = jax.random.PRNGKey(ctx + B)
            nb = B * (ctx // PAGE) + 1
            bits = jax.random.bits(key, (nb, PAGE, R + ROPE), jnp.uint8) & jnp.uint8(0xBF)  # |x| ≤ 1.875, no NaN
            pool = jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn)
            bt = jax.random.permutation(jax.random.fold_in(key, 1), jnp.arange(1, nb, dtype=jnp.int32)).reshape(
                B, ctx // PAGE)
            rng = np.random.default_rng(ctx)
            sel = jnp.asarray(np.stack([np.stack([np.sort(rng.choice(ctx, TOPK, replace=False)) for _ in range(B)])
                                        for _ in range(ARGS.chain)]), jnp.int32)
            lat_bytes = B * TOPK * fmt.bytes_per_token
            for H in map(int, ARGS.heads.split(",")):
                q = jnp.asarray(rng.standard_normal((B, H, R + ROPE)), jnp.float32)
                kw = dict(fmt=fmt, layer_scale=jnp.float32(0.5), scale=192 ** -0.5, value_dim=R)
                shape = f"ctx={ctx} B={B} H={H}"
                # the pool passed as an argument everywhere: closed over, jit would embed it as a constant
                ref = jax.jit(lambda q, bt, idx, pool: sparse.decode(q, (pool,), bt, idx, backend="reference", **kw))
                o_r, lse_r = ref(q, bt, sel[0], pool)

                def time_op(kernel_kw, name):
                    f = jax.jit(lambda q, bt, idx, pool: sparse.decode(q, (pool,), bt, idx, backend="gpu",
                                                                       kernel_kw=kernel_kw, **kw))
                    try:
                        o, lse = f(q, bt, sel[0], pool)
                        err = max(rel_rms(o, o_r), rel_rms(lse, lse_r))
                        t = device_seconds(f, q, bt, sel, pool, stacked=(2,))[0]
                    except Exception as e:  # noqa: BLE001
                        print(f"{name} {shape}: ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)
                        return
                    row(name, shape, t * 1e6, lat_bytes / t / 1e12, bw, err)

                what = ARGS.ops.split(",")
                pool_u8 = jax.lax.bitcast_convert_type(pool, jnp.uint8).reshape(nb * PAGE, R + ROPE)
                for cfg in configs if "kernel" in what or "trace" in what else ():
                    c = sm.MgpuSparseConfig(**cfg)
                    # the kernel's q input: prepared by XLA (`prepare_q`, or its two e4m3 planes for the fp8
                    # logits), or raw with prep="kernel"
                    if c.prep == "kernel":
                        q16, c2 = q, None
                    elif c.logits_mma == "fp8":
                        *q16, c2 = sm.prepare_q_fp8(q, 0.5 * 192 ** -0.5)
                        q16 = tuple(q16)
                    else:
                        q16, c2 = sm.prepare_q(q, 0.5 * 192 ** -0.5)
                    slots = jax.jit(jax.vmap(lambda idx: sm.prepare_slots(idx, c.splits, c.warpgroups)))(sel)
                    # a corner of o: the chain's per-call sum then reads 64 bytes, not the 8 MB of partials
                    kern = jax.jit(lambda q16, c2, slots, bt, pool_u8: jax.tree_util.tree_map(
                        lambda x: x[..., :1], sm.kernel_call(q16, c2, slots, bt, pool_u8, R=R, page=PAGE, config=c,
                                                             H=H, layer_scale=0.5, scale=192 ** -0.5)))
                    if "trace" in what:
                        trace_kernel(c, q16, c2, slots, bt, pool_u8, H, shape)
                    if "kernel" not in what:
                        continue
                    try:
                        t = device_seconds(kern, q16, c2, slots, bt, pool_u8, stacked=(2,))[0]
                        row(f"mgpu kernel alone {json.dumps(cfg, separators=(',', ':'))}", shape, t * 1e6,
                            lat_bytes / t / 1e12, bw, float("nan"))
                    except Exception as e:  # noqa: BLE001
                        print(f"kernel alone {cfg}: ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)
                if "gather" in what:  # the same rows read by an XLA gather fused into a per-sequence sum
                    def gather_sum(bt, idx, pool_u8):
                        rows = jnp.take_along_axis(bt, idx // PAGE, axis=1) * PAGE + idx % PAGE  # [B, k]
                        return jnp.sum(pool_u8[rows].astype(jnp.int32), axis=1)  # [B, c]
                    t = device_seconds(jax.jit(gather_sum), bt, sel, pool_u8, stacked=(1,))[0]
                    row("XLA gather + sum of the same rows", shape, t * 1e6, lat_bytes / t / 1e12, bw, float("nan"))
                if "floor" in what:  # one small fusion writing o [B, H, R] and lse [B, H], plus the chain's sum
                    def outputs_only(q, bt, idx, pool):
                        return jnp.broadcast_to(q[:, :, :1], (B, H, R)), q[:, :, 0]
                    t = device_seconds(jax.jit(outputs_only), q, bt, sel, pool, stacked=(2,))[0]
                    row("chain floor: the op's outputs written from q alone", shape, t * 1e6, lat_bytes / t / 1e12, bw,
                        float("nan"))
                if "op" in what:
                    if not ARGS.no_triton:
                        time_op(sparse_gpu_triton.storage_preset(B, H), "triton storage preset (op)")
                    for cfg in json.loads(ARGS.op_configs) if ARGS.op_configs else configs:
                        time_op(dict(cfg, impl="mgpu"), f"mgpu op {json.dumps(cfg, separators=(',', ':'))}")
    out = os.environ.get("OUT")
    if out:
        json.dump(dict(rows=ROWS, jax=jax.__version__, copy_TBps=bw / 1e12), open(os.path.join(out, "mla_mgpu.json"),
                                                                                  "w"), indent=1)


if __name__ == "__main__":
    main()
