#!/usr/bin/env python3
"""Summarise a jax.profiler trace: where the time went, per process (device lanes first), as a table.

    python3 bench/trace_summary.py TRACE_DIR                  # the newest *.trace.json.gz under TRACE_DIR
    python3 bench/trace_summary.py TRACE_DIR --top 40 --steps 212     # also per decode step (212 in the trace)

TRACE_DIR is what `POST /stop_profile` names (`kimi_jax.serve --profile-dir`), or any `jax.profiler.start_trace`
directory. Per process of the trace (`/device:GPU:0`, `/host:CPU`, ...): the complete events grouped by name, the
top `--top` by total time, each with its count, total and mean, and its share of all event time in that process
(host events nest, so their shares overlap; kernels on a device stream do not). Python
function events (`$file:line name`, from the host tracer) are left out unless `--python`. `--steps N` also divides
every total by N (the decode steps the trace holds: `bench/serve.py --profile` reads them from /stats), a per-step
view. Writes the table to stdout and, with `--json FILE`, the same rows as JSON.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import sys


def find_trace(path: str) -> str:
    """The trace file: `path` itself, or the newest `*.trace.json.gz` below it."""
    if os.path.isfile(path):
        return path
    found = glob.glob(os.path.join(path, "**", "*.trace.json.gz"), recursive=True)
    if not found:
        raise FileNotFoundError(f"no *.trace.json.gz under {path}")
    return max(found, key=os.path.getmtime)


def load_events(path: str) -> list[dict]:
    """The Chrome-trace events of a ``*.trace.json.gz``."""
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def summarise(events: list[dict], *, top: int = 25, python: bool = False, steps: int | None = None) -> list[dict]:
    """Rows ``{process, name, count, total_us, mean_us, share[, per_step_us]}`` from Chrome-trace ``events``: per
    process, complete ("X") events grouped by name, the ``top`` largest totals, device processes first.
    ``steps``: also each total divided by it."""
    names = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name" and "pid" in e}
    totals: dict = collections.defaultdict(lambda: collections.defaultdict(lambda: [0, 0.0]))
    for e in events:
        name = e.get("name", "")
        if e.get("ph") != "X" or (name.startswith("$") and not python):
            continue
        t = totals[names.get(e.get("pid"), str(e.get("pid")))][name]
        t[0] += 1
        t[1] += float(e.get("dur", 0.0))
    rows = []
    for proc in sorted(totals, key=lambda p: (0 if "device" in p.lower() else 1, p)):
        busy = sum(t[1] for t in totals[proc].values()) or 1.0
        for name, (count, total) in sorted(totals[proc].items(), key=lambda kv: -kv[1][1])[:top]:
            row = {"process": proc, "name": name, "count": count, "total_us": round(total, 1),
                   "mean_us": round(total / count, 2), "share": round(total / busy, 4)}
            if steps:
                row["per_step_us"] = round(total / steps, 2)
            rows.append(row)
    return rows


def render(rows: list[dict]) -> str:
    """``summarise``'s rows as a Markdown table."""
    per = bool(rows) and "per_step_us" in rows[0]
    out = ["| process | name | count | total ms | mean µs | share |" + (" per step µs |" if per else ""),
           "|---|---|---:|---:|---:|---:|" + ("---:|" if per else "")]
    for r in rows:
        name = r["name"] if len(r["name"]) <= 90 else r["name"][:87] + "..."
        out.append(f"| {r['process']} | {name} | {r['count']} | {r['total_us'] / 1e3:.3f} | {r['mean_us']:.1f} | "
                   f"{r['share']:.3f} |" + (f" {r['per_step_us']:.1f} |" if per else ""))
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", help="a trace directory (or a *.trace.json.gz file)")
    ap.add_argument("--top", type=int, default=25, help="rows per process (default 25)")
    ap.add_argument("--python", action="store_true", help="keep the host tracer's Python function events")
    ap.add_argument("--steps", type=int, default=None, metavar="N", help="also divide every total by N")
    ap.add_argument("--json", metavar="FILE", help="write the rows as JSON too")
    args = ap.parse_args(argv)
    path = find_trace(args.trace)
    events = load_events(path)
    rows = summarise(events, top=args.top, python=args.python, steps=args.steps)
    print(f"# {path}: {len(events)} events")
    print(render(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"trace": path, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
