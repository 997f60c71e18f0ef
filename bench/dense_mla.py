#!/usr/bin/env python3
"""Dense paged MLA (MLA layers without an indexer: Kimi-Linear) on a prefill chunk: its time against the width of
the block table it is given, with the chunk's queries at the same positions.

    python bench/dense_mla.py                                   # CPU: T = 512 after 256 cached tokens
    python bench/dense_mla.py --tokens 4096 --start 28672 --widths 32768,131072 --heads 32   # on an accelerator

The engine hands every prefill chunk the sequence's whole block table (`--max-model-len` wide); the reference
(`pallas_kernels.mla.paged_dense.reference`, the path of every prefill chunk) reads pages only up to the furthest
query's, so the time should follow `--start + --tokens`, not the width. Prints one JSON line per width: milliseconds
per call (median of `--reps`), and the result's largest difference from the narrowest table's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.realpath(__file__))
sys.path[:] = [os.path.dirname(HERE)] + [p for p in sys.path if os.path.realpath(p or os.curdir) != HERE]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from kimi_jax import quant  # noqa: E402
from kimi_jax.cache import PAGE_TOKENS  # noqa: E402
from pallas_kernels.mla import paged_dense  # noqa: E402


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
    args = ap.parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
