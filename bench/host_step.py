"""Host work between two decode steps, each against what it replaced, measured side by side in one run:

* block table: kept across steps (`BlockTable.update`) vs built fresh from every running sequence's page list
  (`BlockAllocator.block_table`). Each step every row decodes one token (a new page every 64 tokens, as the
  engine's `_grow` does); the kept table must equal the fresh one after every timed step.
* parameters: calling a compiled program with the model's parameters as a flat list of arrays (what `ModelRunner`
  passes) vs as the model's `nnx.State`. The per-call cost is per leaf, not per byte, so each preset's parameter
  tree is rebuilt with one-element arrays (the full sizes do not fit a host) and passed to a program that reads one.

    python bench/host_step.py                                  # both, 32 rows, 8K / 128K / 1M tokens per row
    python bench/host_step.py --only table --rows 1 --contexts 1048576

Prints one JSON line per case, both times in microseconds and their ratio. No accelerator: this is host time.
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


def block_table_case(rows: int, context: int, max_model_len: int, steps: int) -> dict:
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
    return {"case": "block table", "rows": rows, "context_tokens": context, "max_blocks": max_blocks, "steps": n,
            "fresh_us": round(fresh_s / n * 1e6, 1), "kept_us": round(kept_s / n * 1e6, 1),
            "fresh_over_kept": round(fresh_s / kept_s, 1)}


def param_call(preset: str, calls: int) -> dict:
    """Per-call time of a compiled program given `preset`'s parameter tree as an `nnx.State` and as a flat list."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from kimi_jax.config import get_preset
    from kimi_jax.model import abstract_module

    abstract = nnx.state(abstract_module(get_preset(preset)), nnx.Param)
    state = jax.tree.map(lambda a: jnp.zeros((1,), a.dtype), abstract)
    leaves = jax.tree.leaves(state)
    tree = jax.tree.structure(state)
    as_state = jax.jit(lambda p: jax.tree.leaves(p)[0] + 1).lower(state).compile()
    as_list = jax.jit(lambda ls: jax.tree.leaves(jax.tree.unflatten(tree, ls))[0] + 1).lower(leaves).compile()
    times = {}
    for name, fn, arg in (("state", as_state, state), ("list", as_list, leaves)):
        jax.block_until_ready(fn(arg))
        t0 = time.perf_counter()
        for _ in range(calls):
            out = fn(arg)
        jax.block_until_ready(out)
        times[name] = (time.perf_counter() - t0) / calls
    return {"case": "parameters", "preset": preset, "leaves": len(leaves), "calls": calls,
            "state_us": round(times["state"] * 1e6, 1), "list_us": round(times["list"] * 1e6, 1),
            "state_over_list": round(times["state"] / times["list"], 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=32, help="running sequences (slots) per step")
    ap.add_argument("--contexts", default="8192,131072,1048576", help="tokens of context per row, comma-separated")
    ap.add_argument("--max-model-len", type=int, default=1 << 20, help="the table's width, in tokens (1M: 16,384 "
                    "pages, K3.1's)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--presets", default="kimi-k3.1-reduced,kimi-linear-48b,kimi-k3.1-pro",
                    help="parameter trees to pass, comma-separated")
    ap.add_argument("--calls", type=int, default=200, help="calls per parameter case")
    ap.add_argument("--only", choices=("table", "parameters"))
    args = ap.parse_args()
    results = []
    if args.only in (None, "table"):
        for context in (int(c) for c in args.contexts.split(",")):
            if context + args.steps > args.max_model_len:
                raise SystemExit(f"--contexts {context} + {args.steps} steps exceeds --max-model-len "
                                 f"{args.max_model_len}")
            results.append(block_table_case(args.rows, context, args.max_model_len, args.steps))
    if args.only in (None, "parameters"):
        results += [param_call(p, args.calls) for p in args.presets.split(",")]
    for row in results:
        row.update(cpu=cpu_name(), numpy=np.__version__, date=time.strftime("%Y-%m-%d"))
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
