"""Conversion benchmark: peak RSS and throughput of `python -m convert` on a synthetic multi-shard K3.1 checkpoint.

    python bench/convert.py [--layers 2] [--experts 32] [--workdir /tmp/kimi_jax_convert_bench] [--keep]

The checkpoint is the full-width Kimi K3.1 Pro layout (hidden 7168, vocab 163840, 96 KDA / MLA heads, latent MoE
3584 -> 3072, MXFP4 experts with E8M0 scales, bf16 elsewhere, fp32 A_log / dt_bias / conv / o_norm / bias, vision
tensors) at reduced depth and expert count, written with seeded random values into 2 GiB shards under --workdir
(never into the repository). `python -m convert` then runs in a child process whose resident set size (with any
children) is sampled every 20 ms. Reported: source size, largest stacked tensor and largest array, peak RSS, wall
time and MB/s (source bytes / conversion wall time; the source was just written, so it is largely in the page
cache). A table and a JSON line are printed; `--json FILE` also writes the JSON there.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import threading
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

HERE = os.path.dirname(os.path.abspath(__file__))
# this file is named like the `convert` package: keep bench/ off the import path so `import convert` finds the package
sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != HERE]


def bench_config(layers: int, experts: int):
    from kimi_jax.config import get_preset, k3_layer_kinds

    cfg = get_preset("kimi-k3.1-pro")
    moe = dataclasses.replace(cfg.moe, num_experts=experts, top_k=min(cfg.moe.top_k, experts))
    return cfg.replace(layer_kinds=k3_layer_kinds(layers), dense_layers=(0,), moe=moe)


def sample_rss(pid: int, stop: threading.Event, out: dict) -> None:
    import psutil

    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    while not stop.is_set():
        try:
            procs = [root] + root.children(recursive=True)
            rss = sum(p.memory_info().rss for p in procs if p.is_running())
            out["peak"] = max(out.get("peak", 0), rss)
        except psutil.Error:
            pass
        time.sleep(0.02)


def machine() -> str:
    import psutil

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{os.cpu_count()}-core CPU ({cpu}), {psutil.virtual_memory().total / 2**30:.0f} GiB RAM, {platform.system()}"


def versions() -> str:
    import importlib.metadata as md

    names = ("jax", "flax", "orbax-checkpoint", "numpy", "safetensors", "ml_dtypes")
    parts = [f"python {platform.python_version()}"]
    for n in names:
        try:
            parts.append(f"{n} {md.version(n)}")
        except md.PackageNotFoundError:
            pass
    return ", ".join(parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2, help="decoder layers (K3 pattern: last one MLA; default 2)")
    ap.add_argument("--experts", type=int, default=32, help="routed experts per MoE layer (default 32)")
    ap.add_argument("--workdir", default="/tmp/kimi_jax_convert_bench")
    ap.add_argument("--shard-size", default=2 << 30, type=int, help="source shard bytes (default 2 GiB)")
    ap.add_argument("--part-size", default="1GiB", help="passed to python -m convert --part-size")
    ap.add_argument("--dtype", default="bf16", choices=("keep", "bf16", "fp8"), help="passed to python -m convert")
    ap.add_argument("--keep", action="store_true", help="keep the synthetic checkpoint and the output")
    ap.add_argument("--json", metavar="FILE", help="also write the result as JSON to FILE")
    args = ap.parse_args(argv)

    from convert.synthetic import k3_tensor_specs, write_k3_checkpoint
    from convert.safetensors_io import DTYPES

    if os.path.realpath(args.workdir).startswith(os.path.realpath(os.path.join(HERE, ".."))):
        ap.error("--workdir must be outside the repository")
    cfg = bench_config(args.layers, args.experts)
    specs = k3_tensor_specs(cfg, mxfp4=True, dtype="BF16")
    sizes = {n: math.prod(s) * DTYPES[d].itemsize for n, d, s in specs}
    total = sum(sizes.values())
    stacked = {}
    for n, b in sizes.items():
        if ".experts." in n:
            key = n.split(".experts.")[0] + "." + n.split(".")[-2] + "." + n.split(".")[-1]
            stacked[key] = stacked.get(key, 0) + b
    largest_stacked = max(stacked.values()) if stacked else 0
    largest_tensor = max(sizes.values())
    if total < 4 << 30:
        print(f"warning: the synthetic checkpoint is only {total / 2**30:.2f} GiB (< 4 GiB)", file=sys.stderr)

    src, dst = os.path.join(args.workdir, "src"), os.path.join(args.workdir, "dst")
    shutil.rmtree(args.workdir, ignore_errors=True)
    os.makedirs(args.workdir)
    try:
        load_before = os.getloadavg()
        t0 = time.time()
        info = write_k3_checkpoint(src, cfg, seed=0, mxfp4=True, dtype="BF16", shard_bytes=args.shard_size,
                                   progress=True)
        t_gen = time.time() - t0
        cmd = [sys.executable, "-m", "convert", src, dst, "--dtype", args.dtype, "--part-size", args.part_size,
               "--quiet"]
        stop, rss = threading.Event(), {}
        t0 = time.time()
        proc = subprocess.Popen(cmd, cwd=args.workdir)
        th = threading.Thread(target=sample_rss, args=(proc.pid, stop, rss), daemon=True)
        th.start()
        rc = proc.wait()
        t_conv = time.time() - t0
        stop.set()
        th.join()
        if rc != 0:
            print(f"conversion failed with exit code {rc}", file=sys.stderr)
            return rc
        meta = json.load(open(os.path.join(dst, "kimi_jax_checkpoint.json")))
        out_bytes = sum(b for e in meta["entries"] for _, (dt, shp) in e["extra"]["arrays"].items()
                        for b in [math.prod(shp) * DTYPES[dt].itemsize])
        result = {
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": machine(),
            "versions": versions(),
            "config": f"kimi-k3.1-pro layout, {args.layers} layers ({'/'.join(cfg.layer_kinds)}), "
                      f"{args.experts} MXFP4 experts/MoE layer, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}",
            "dtype": args.dtype,
            "part_size": args.part_size,
            "source_gib": round(total / 2**30, 3),
            "source_files": info["files"],
            "tensors": info["tensors"],
            "output_gib": round(out_bytes / 2**30, 3),
            "parts": len(meta["parts"]),
            "largest_stacked_tensor_mib": round(largest_stacked / 2**20, 1),
            "largest_tensor_mib": round(largest_tensor / 2**20, 1),
            "peak_rss_mib": round(rss.get("peak", 0) / 2**20, 1),
            "generate_s": round(t_gen, 1),
            "convert_s": round(t_conv, 1),
            "convert_mb_s": round(total / 1e6 / t_conv, 1),
            "load_avg_1m_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        }
    finally:
        if not args.keep:
            shutil.rmtree(args.workdir, ignore_errors=True)

    rows = [("source", f"{result['source_gib']} GiB in {result['source_files']} shards, {result['tensors']} tensors"),
            ("output", f"{result['output_gib']} GiB in {result['parts']} Orbax parts (--dtype {args.dtype})"),
            ("largest stacked tensor", f"{result['largest_stacked_tensor_mib']} MiB"),
            ("largest tensor", f"{result['largest_tensor_mib']} MiB (embed_tokens / lm_head)"),
            ("peak RSS (convert process)", f"{result['peak_rss_mib']} MiB"),
            ("conversion time", f"{result['convert_s']} s"),
            ("throughput", f"{result['convert_mb_s']} MB/s"),
            ("(generation time)", f"{result['generate_s']} s"),
            ("(load average, 1 min, before / after)", " / ".join(map(str, result["load_avg_1m_before_after"])))]
    w = max(len(a) for a, _ in rows)
    print()
    for a, b in rows:
        print(f"{a:<{w}}  {b}")
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
