#!/usr/bin/env python3
"""Dense paged MLA (MLA layers without an indexer: Kimi-Linear) on a prefill chunk: its time against the width of
the block table it is given, with the chunk's queries at the same positions.

    python bench/dense_mla.py                                   # CPU: T = 512 after 256 cached tokens
    python bench/dense_mla.py --tokens 4096 --start 28672 --widths 32768,131072 --heads 32   # on an accelerator
    python bench/dense_mla.py --decode --batches 1,32 --start 8192 --widths 16384,131072 \
        --heads 32 --latent 512 --rope 64                      # decode steps on a GPU (Kimi-Linear-48B's MLA)

The engine hands every prefill chunk the sequence's whole block table (`--max-model-len` wide); the reference
(`pallas_kernels.mla.paged_dense.reference`, the path of every prefill chunk) reads pages only up to the furthest
query's, so the time should follow `--start + --tokens`, not the width. Prints one JSON line per width: milliseconds
per call (median of `--reps`), and the result's largest difference from the narrowest table's.

`--decode`: one query per sequence at position `--start` for each of `--batches` sequences, on the platform's decode
kernel (`dense_paged_mla`, backend "auto": on a GPU the Triton kernel walking positions 0 … p) beside the path it
replaced on a GPU (the sparse kernel over every table position, −1 past p). One JSON line per (batch, width, path):
µs per call (`_timing.device_seconds`, `--chain` different queries chained in one program: no host dispatch; the
rows can stay in L2 when B·start rows are small), the latent bytes read per second and their fraction of an XLA copy
of that many bytes measured in the same run (read + write bytes over its time), and the difference from the first
path's result.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.realpath(__file__))
sys.path[:] = [os.path.dirname(HERE)] + [p for p in sys.path if os.path.realpath(p or os.curdir) != HERE] + [HERE]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from kimi_jax import quant  # noqa: E402
from kimi_jax.cache import PAGE_TOKENS  # noqa: E402
from pallas_kernels.mla import paged_dense, sparse  # noqa: E402

from _timing import device_seconds  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=512, help="queries in the chunk (default 512)")
    ap.add_argument("--start", type=int, default=256, help="cached positions before the chunk (default 256)")
    ap.add_argument("--widths", default="1024,8192,32768", help="block-table widths in positions, comma-separated")
    ap.add_argument("--heads", type=int, default=8, help="query heads (default 8; Kimi-Linear-48B: 32)")
    ap.add_argument("--latent", type=int, default=256, help="latent width R (default 256; Kimi-Linear: 512)")
    ap.add_argument("--rope", type=int, default=32, help="rope width (default 32; Kimi-Linear: 64)")
    ap.add_argument("--kv-dtype", default="bf16", choices=["fp32", "bf16", "fp8"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--decode", action="store_true", help="time decode steps (T = 1) instead of a prefill chunk")
    ap.add_argument("--batches", default="1,32", help="--decode: sequences per step, comma-separated")
    ap.add_argument("--chain", type=int, default=8, help="--decode: calls chained in one timed program")
    args = ap.parse_args(argv)
    if args.decode:
        return decode_main(args)
    widths = sorted(int(w) for w in args.widths.split(","))
    if args.start + args.tokens > widths[0]:
        ap.error(f"the narrowest table ({widths[0]}) must hold the chunk's positions ({args.start + args.tokens})")
    fmt = quant.LatentFormat(args.kv_dtype, args.latent, args.rope)
    rng = np.random.default_rng(0)
    pages = -(-widths[-1] // PAGE_TOKENS)
    rows = jnp.asarray(rng.standard_normal((pages + 1, PAGE_TOKENS, args.latent + args.rope)), jnp.float32)
    parts = fmt.quantize(rows, 1.0)
    q = jnp.asarray(rng.standard_normal((1, args.tokens, args.heads, args.latent + args.rope)), jnp.bfloat16)
    pos = jnp.arange(args.start, args.start + args.tokens, dtype=jnp.int32)[None]
    first = None
    for width in widths:
        table = jnp.arange(1, -(-width // PAGE_TOKENS) + 1, dtype=jnp.int32)[None]
        call = lambda: paged_dense.reference(q, parts, table, pos, 1.0, fmt=fmt, scale=0.1,  # noqa: E731
                                             value_dim=args.latent)
        o, _ = jax.block_until_ready(call())
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            jax.block_until_ready(call())
            times.append(time.perf_counter() - t0)
        first = o if first is None else first
        print(json.dumps({"width": width, "tokens": args.tokens, "start": args.start, "heads": args.heads,
                          "ms": round(1e3 * float(np.median(times)), 2),
                          "max_diff_vs_narrowest": float(jnp.max(jnp.abs(o - first))),
                          "device": str(jax.devices()[0]), "jax": jax.__version__}), flush=True)
    return 0


def _copy_rate(nbytes: int) -> float:
    """Bytes read + written per second by XLA copying `nbytes` of bf16 (negation: nothing to fold away)."""
    x = jnp.ones((max(1, nbytes // 2),), jnp.bfloat16)
    t, _ = device_seconds(jax.jit(jnp.negative), x)
    return 2 * x.size * 2 / t


def decode_main(args) -> int:
    """--decode: the dense decode kernel against the full-width sparse selection, per batch and table width."""
    fmt = quant.LatentFormat(args.kv_dtype, args.latent, args.rope)
    widths = sorted(int(w) for w in args.widths.split(","))
    if args.start >= widths[0]:
        raise SystemExit(f"--start {args.start} must be inside the narrowest table ({widths[0]})")
    rng = np.random.default_rng(0)
    row_bytes = sum(np.dtype(p.dtype).itemsize * p.shape[-1] for p in fmt.quantize(jnp.zeros((1, 1, args.latent
                                                                                                + args.rope)), 1.0))
    kw = dict(fmt=fmt, scale=0.1, value_dim=args.latent, layer_scale=1.0, precision="storage")
    live = -(-(args.start + 1) // PAGE_TOKENS)  # pages holding positions 0 … start
    for batch in (int(b) for b in args.batches.split(",")):
        # each sequence's own live pages after page 0, which every table entry past them names (never read)
        rows = jax.random.normal(jax.random.PRNGKey(batch), (1 + batch * live, PAGE_TOKENS, args.latent + args.rope))
        parts = fmt.quantize(rows, 1.0)
        del rows
        q = jnp.asarray(rng.standard_normal((args.chain, batch, 1, args.heads, args.latent + args.rope)),
                        jnp.bfloat16)
        pos = jnp.full((batch, 1), args.start, jnp.int32)
        read = batch * (args.start + 1) * row_bytes
        copy = _copy_rate(max(read, 1 << 28))
        for width in widths:
            n_pages = -(-width // PAGE_TOKENS)
            j = jnp.arange(n_pages, dtype=jnp.int32)[None]
            table = jnp.where(j < live, 1 + jnp.arange(batch, dtype=jnp.int32)[:, None] * live + j, 0)
            s = jnp.arange(n_pages * PAGE_TOKENS, dtype=jnp.int32)
            idx = jnp.where(s[None, None] <= pos[..., None], s[None, None], -1)  # [B, 1, S]
            paths = {
                "dense": lambda q_, t=table: paged_dense.dense_paged_mla(q_, parts, t, pos, **kw),
                "sparse_full_table": lambda q_, t=table, i=idx: sparse.sparse_mla(q_, parts, t, i, **kw),
            }
            first = None
            for name, fn in paths.items():
                o, _ = jax.block_until_ready(jax.jit(fn)(q[0]))
                t, n = device_seconds(fn, q, stacked=(0,))
                first = o if first is None else first
                print(json.dumps({"path": name, "batch": batch, "start": args.start, "width": width,
                                  "heads": args.heads, "kv_dtype": args.kv_dtype, "us": round(1e6 * t, 1),
                                  "read_TBps": round(read / t / 1e12, 3), "read_of_copy": round(read / t / copy, 3),
                                  "copy_TBps": round(copy / 1e12, 3), "chain": n,
                                  "max_diff_vs_first": float(jnp.max(jnp.abs(o - first))),
                                  "device": str(jax.devices()[0]), "jax": jax.__version__}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
