#!/usr/bin/env python3
"""What an optimized XLA program runs at its top level: which work XLA's command buffers (CUDA graphs) hold and
what runs outside them, from an XLA dump.

    XLA_FLAGS="--xla_dump_to=/tmp/dump --xla_dump_hlo_module_re=.*step.*" python -m kimi_jax.serve ...
    python3 bench/hlo_summary.py /tmp/dump                    # every *after_optimizations.txt module below it
    python3 bench/hlo_summary.py /tmp/dump --module step      # modules whose file name contains "step"
    python3 bench/hlo_summary.py /tmp/dump --by-source 25     # and the 25 source lines that make the most thunks

(`bench/serve.py --xla-flags=...` passes the dump flags to the server it launches.) Per module, the entry
computation's instructions by opcode -- each becomes a thunk of the GPU runtime -- with bookkeeping (parameter,
constant, tuple, get-tuple-element, bitcast) left out; for `call`s the callee (older XLA outlines each command buffer
as a call of a `command_buffer` computation) with the instructions it holds; the custom-call targets; and every
conditional and while loop outside a command buffer with the op name of its source (a conditional there copies its
predicate to the host and waits for the device, once per run). XLA as of jax 0.11 forms its command buffers from
the thunk sequence after this HLO (no `command_buffer` calls appear): there a conditional is outside them unless
CONDITIONAL is among `--xla_gpu_enable_command_buffer`'s types, and runs of fusions and custom calls are inside.

`--by-source N` counts the thunks by the line of this repository's code they came from (the innermost frame of the
instruction's `stack_frame_id` in the dump's stack-frame table that lies under the repository root): every thunk is
a kernel launch a step pays for on the device and, inside a command buffer, a command the host records or updates,
so this shows which code to fuse first.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re

BOOKKEEPING = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast"}
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*.*?\s([a-z][a-z0-9\-]*)\(")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")


def computations(text: str) -> tuple[dict[str, list[tuple[str, str, str]]], str]:
    """HLO text -> ({computation: [(instruction name, opcode, line)]}, entry computation name)."""
    comps: dict[str, list] = {}
    entry, current = "", None
    for line in text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m and not line.startswith("HloModule"):
                current = m.group(2)
                comps[current] = []
                if m.group(1):
                    entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTR.match(line)
        if m:
            comps[current].append((m.group(1), m.group(2), line))
    return comps, entry


def _attr(line: str, key: str) -> str:
    m = re.search(key + r'=("([^"]*)"|%?([\w.\-]+))', line)
    return "" if m is None else (m.group(2) if m.group(2) is not None else m.group(3))


_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


def stack_frames(text: str) -> dict[int, list[tuple[str, str, int]]]:
    """The dump's stack-frame table -> {stack_frame_id: [(file, function, line), innermost first]}."""
    tables: dict[str, dict[int, str]] = {}
    current = None
    for line in text.splitlines():
        if line in _TABLES:
            current = tables.setdefault(line, {})
            continue
        m = re.match(r"^(\d+) (.*)$", line) if current is not None else None
        if m is None:
            if tables.keys() >= set(_TABLES) and current is not None:
                break
            current = None
            continue
        current[int(m.group(1))] = m.group(2)
    if not tables.keys() >= set(_TABLES):
        return {}
    fields = {name: {k: dict((a, int(b)) for a, b in re.findall(r"(\w+)=(\d+)", v)) for k, v in tables[name].items()}
              for name in ("FileLocations", "StackFrames")}
    names = {k: v.strip('"') for k, v in tables["FileNames"].items()}
    funcs = {k: v.strip('"') for k, v in tables["FunctionNames"].items()}
    locs = {k: (names[d["file_name_id"]], funcs[d["function_name_id"]], d["line"])
            for k, d in fields["FileLocations"].items()}
    frames = {}
    for k in fields["StackFrames"]:
        chain, fid = [], k
        while fid in fields["StackFrames"] and len(chain) < 64:
            d = fields["StackFrames"][fid]
            chain.append(locs[d["file_location_id"]])
            parent = d.get("parent_frame_id", 0) - 1  # 1-based, 0: none
            fid = parent if parent != fid else 0
        frames[k] = chain
    return frames


def thunks_by_source(text: str, root: str) -> collections.Counter:
    """The entry computation's thunks counted by `file:line (function)` of the innermost frame under `root`."""
    frames = stack_frames(text)
    comps, entry = computations(text)
    counts = collections.Counter()
    for _, op, line in comps.get(entry, []):
        if op in BOOKKEEPING:
            continue
        m = re.search(r"stack_frame_id=(\d+)", line)
        ours = [f for f in frames.get(int(m.group(1)), []) if f[0].startswith(root)] if m else []
        counts[f"{os.path.relpath(ours[0][0], root)}:{ours[0][2]} ({ours[0][1]})" if ours else "(no source)"] += 1
    return counts


def summarise(text: str) -> dict:
    """The entry computation's thunks of one optimized module (see the module docstring)."""
    comps, entry = computations(text)
    top = [(n, op, line) for n, op, line in comps.get(entry, []) if op not in BOOKKEEPING]
    ops = collections.Counter(op for _, op, _ in top)
    calls = collections.Counter()
    held = collections.Counter()
    for _, op, line in top:
        if op == "call":
            callee = _attr(line, "to_apply")
            kind = "command_buffer" if "command_buffer" in callee else callee
            calls[kind] += 1
            held[kind] += sum(1 for _, o, _ in comps.get(callee, []) if o not in BOOKKEEPING)
    targets = collections.Counter(_attr(line, "custom_call_target") for _, op, line in top if op == "custom-call")
    branches = [(op, _attr(line, "op_name")) for _, op, line in top if op in ("conditional", "while")]
    return {"thunks": sum(ops.values()), "ops": dict(ops.most_common()), "calls": dict(calls),
            "instructions_in_calls": dict(held), "custom_call_targets": dict(targets.most_common()),
            "conditionals_and_whiles": branches}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dump", help="an --xla_dump_to directory, or one *after_optimizations.txt file")
    ap.add_argument("--module", default="", help="only files whose name contains this")
    ap.add_argument("--by-source", type=int, default=0, metavar="N",
                    help="also list the N source lines of this repository that make the most thunks")
    args = ap.parse_args(argv)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    files = ([args.dump] if os.path.isfile(args.dump)
             else sorted(glob.glob(os.path.join(args.dump, "**", "*after_optimizations.txt"), recursive=True)))
    files = [f for f in files if args.module in os.path.basename(f)]
    if not files:
        print(f"no *after_optimizations.txt under {args.dump} (dump with --xla_dump_to and --xla_dump_hlo_as_text)")
        return 1
    for path in files:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        s = summarise(text)
        print(f"## {os.path.basename(path)}: {s['thunks']} top-level instructions (thunks)")
        print("  by opcode: " + ", ".join(f"{k} {v}" for k, v in s["ops"].items()))
        for kind, n in s["calls"].items():
            print(f"  calls of {kind}: {n}, holding {s['instructions_in_calls'][kind]} instructions")
        if s["custom_call_targets"]:
            print("  custom calls outside: " + ", ".join(f"{k} {v}" for k, v in s["custom_call_targets"].items()))
        for op, name in s["conditionals_and_whiles"]:
            print(f"  {op} outside a command buffer: {name or '(no op name)'}")
        if args.by_source:
            print("  thunks by source line:")
            for where, n in thunks_by_source(text, root).most_common(args.by_source):
                print(f"    {n:5d}  {where}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
