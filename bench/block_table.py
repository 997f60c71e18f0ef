"""Host time per decode step spent on the block table: kept across steps (`BlockTable.update`) against built fresh
from every running sequence's page list (`BlockAllocator.block_table`), the same steps, one process, one run.

    python bench/block_table.py                        # 32 rows; 8K, 128K and 1M tokens of context per row
    python bench/block_table.py --rows 1 --contexts 1048576

Each step every row decodes one token (a new page every 64 tokens, as the engine's `_grow` does); the kept table
must equal the fresh one after every timed step. Prints one JSON line per context length with both times in
microseconds and their ratio. No accelerator: this is host work that sits between two device steps.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.realpath(__file__))
sys.path[:] = [os.path.dirname(HERE)] + [p for p in sys.path if os.path.realpath(p or os.curdir) != HERE]

from kimi_jax.cache import PAGE_TOKENS  # noqa: E402
from kimi_jax.paged_cache import BlockAllocator, BlockTable  # noqa: E402


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def run(rows: int, context: int, max_model_len: int, steps: int) -> dict:
    max_blocks = -(-max_model_len // PAGE_TOKENS)
    alloc = BlockAllocator(rows * (max_blocks + 1) + 1, PAGE_TOKENS)
    for r in range(rows):
        alloc.allocate(r, context - r)  # rows cross page boundaries on different steps
    kept = BlockTable(rows, max_blocks)
    fresh_s = kept_s = 0.0
    for step in range(steps):
        for r in range(rows):
            alloc.allocate(r, alloc.tokens(r) + 1)
        t0 = time.perf_counter()
        want = alloc.block_table(list(range(rows)), max_blocks)
        t1 = time.perf_counter()
        got = kept.update({r: alloc.held(r) for r in range(rows)})
        t2 = time.perf_counter()
        if step:  # the first update writes every row: the cost of a slot's first step, not of a steady one
            fresh_s += t1 - t0
            kept_s += t2 - t1
        if not np.array_equal(got, want):
            raise SystemExit(f"kept table differs from the fresh one at step {step}")
    n = steps - 1
    return {"rows": rows, "context_tokens": context, "max_blocks": max_blocks, "steps": n,
            "fresh_us": round(fresh_s / n * 1e6, 1), "kept_us": round(kept_s / n * 1e6, 1),
            "fresh_over_kept": round(fresh_s / kept_s, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=32, help="running sequences (slots) per step")
    ap.add_argument("--contexts", default="8192,131072,1048576", help="tokens of context per row, comma-separated")
    ap.add_argument("--max-model-len", type=int, default=1 << 20, help="the table's width, in tokens (1M: 16,384 "
                    "pages, K3.1's)")
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    for context in (int(c) for c in args.contexts.split(",")):
        if context + args.steps > args.max_model_len:
            raise SystemExit(f"--contexts {context} + {args.steps} steps exceeds --max-model-len {args.max_model_len}")
        row = run(args.rows, context, args.max_model_len, args.steps)
        row.update(cpu=cpu_name(), numpy=np.__version__,
                   date=time.strftime("%Y-%m-%d"))
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
