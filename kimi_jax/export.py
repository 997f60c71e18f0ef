"""`python -m kimi_jax.export`: the engine's programs for a target platform, from abstract shapes (no weights).

Builds the model abstractly on the requested mesh (parameters as `ShapeDtypeStruct`s placed by the partition
rules), builds the serving engine's fixed set of programs (`ModelRunner.program_args`: the decode step, one prefill
program per chunk size, the cache helpers), exports each with `jax.export` for `--platform`, and writes
`DIR/<program>.jax` (serialized `jax.export.Exported`; the decode step is `step.jax`, prefill programs
`prefill_<C>.jax`, token-split ones `prefill_split_<C>.jax`) and `DIR/summary.json`. Exit status 0 only if every program exported.

Exporting for TPU from a CPU host applies Mosaic's real lowering rules (block shapes, memory spaces), so this is
how a program that must run on a TPU pod is checked on a laptop. `--kernels auto` means what "auto" picks on the
target platform. On a CPU host the mesh's devices are faked (JAX's CPU device count is set before its backend
starts).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from sharding.context import KernelConfig
from sharding.mesh import fake_cpu_devices, parse_mesh_spec

from .config import PRESETS, get_preset, load_config
from .engine.engine import DEFAULT_TOKEN_SPLIT_MIN_TOKENS
from .engine.guide import class_table_rows
from .engine.runner import ModelRunner
from .kernels import ATTENTION_PRECISIONS, attention_precision
from .model import _parse_dtype, abstract_model

log = logging.getLogger("kimi_jax.export")

PLATFORMS = {"tpu": "tpu", "cuda": "cuda", "gpu": "cuda", "cpu": "cpu", "rocm": "rocm"}
KERNEL_CHOICES = ("auto", "reference", "tpu", "gpu")
# custom-call targets of the kernel families, as they appear in the exported StableHLO
KERNEL_CALL_TARGETS = ("tpu_custom_call", "mosaic_gpu", "mosaic_gpu_v2", "__gpu$xla.gpu.triton",
                       "triton_kernel_call")
# GPU kernels' custom calls carry no cross-version compatibility guarantee in jax.export: the exported GPU
# programs are for this JAX version (summary.json names it); Mosaic TPU calls are guaranteed
GPU_KERNEL_TARGETS = KERNEL_CALL_TARGETS[1:]
DEFAULT_CHUNKS = {"cpu": (64, 1), "tpu": (1024, 256, 64, 1), "cuda": (1024, 256, 64, 1), "rocm": (1024, 256, 64, 1)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kimi_jax.export", description=__doc__.split("\n\n")[0] + "\n\n" + __doc__.split("\n\n")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  python -m kimi_jax.export --platform tpu --model kimi-k3.1-pro --mesh 8x1 --out /tmp/k31")
    p.add_argument("--platform", required=True, choices=sorted(PLATFORMS), help="target platform of the programs")
    p.add_argument("--model", required=True, help="a preset name (tiny, kimi-k3.1-pro, ...) or a checkpoint "
                   "directory (only its config.json is read)")
    p.add_argument("--mesh", default="1x1", help="AxB (tensor x data) or a named form such as "
                   "expert=8,tensor=1,context=8 (default 1x1)")
    p.add_argument("--dcp", type=int, default=1, help="decode context parallelism ways (1: none)")
    p.add_argument("--token-split-min-tokens", type=int, default=DEFAULT_TOKEN_SPLIT_MIN_TOKENS,
                   help="with --dcp over a context axis, the chunk sizes of at least this many tokens export their "
                        f"token-split prefill program prefill_split_<C>, as serve compiles it (default "
                        f"{DEFAULT_TOKEN_SPLIT_MIN_TOKENS}; 0: none)")
    p.add_argument("--kernels", default="auto", choices=KERNEL_CHOICES,
                   help="kernel implementation of every op family; auto = what auto picks on --platform")
    p.add_argument("--dtype", default="bf16", help="parameter / activation dtype (bf16, fp32)")
    p.add_argument("--attention-precision", default="auto", choices=ATTENTION_PRECISIONS,
                   help="the MLA attention's products, as `serve --attention-precision`: auto (default) = storage "
                        "(bf16 operands, fp32 accumulation) for bf16, exact for fp32")
    p.add_argument("--max-num-seqs", type=int, default=8, help="decode batch slots (default 8)")
    p.add_argument("--max-model-len", type=int, default=4096, help="tokens per sequence (default 4096)")
    p.add_argument("--prefill-chunk-sizes", default=None,
                   help="comma-separated prefill chunk sizes (default 1024,256,64,1 on accelerators, 64,1 on cpu)")
    p.add_argument("--kv-dtype", default="auto", help="paged latent cache format: auto, bf16, fp8, nvfp4, fp32")
    p.add_argument("--index-dtype", default=None, help="index-key format: bf16, fp8, mxfp4 (default by kv dtype)")
    p.add_argument("--speculative-tokens", type=int, default=0, help="also export the verify program (k drafts)")
    p.add_argument("--programs", default=None,
                   help="comma-separated name prefixes of the programs to export (e.g. step,prefill; default all)")
    p.add_argument("--out", required=True, help="output directory (created; existing files are overwritten)")
    return p


def kernel_config(choice: str):
    """--kernels -> KernelConfig: one implementation for every op family."""
    if choice == "auto":
        return KernelConfig()
    if choice == "reference":
        return KernelConfig.reference()
    return KernelConfig(kda=choice, moe=choice, dsa=choice)


def kernel_names(mlir_text: str) -> list:
    """The distinct Pallas kernel names (`kernel_name` attributes of Mosaic calls) in an exported module's text."""
    return sorted(set(re.findall(r'kernel_name\s*=\s*"([^"]+)"', mlir_text)))


def kernel_calls(mlir_text: str) -> dict:
    """{custom-call target: occurrences in the module's text} of the kernel families (a shard_map body shared by
    several layers is emitted once and called, so this counts call sites in the text, not calls at run time)."""
    counts = {}
    for target in KERNEL_CALL_TARGETS:
        n = len(re.findall(r"custom_call\s*@" + re.escape(target) + r"\b", mlir_text)) + \
            len(re.findall(r'call_target_name\s*=\s*"' + re.escape(target) + '"', mlir_text))
        if n:
            counts[target] = n
    return counts


def export_programs(args) -> dict:
    """Export every engine program; returns the summary (also written to `args.out/summary.json`)."""
    platform = PLATFORMS[args.platform]
    cfg = get_preset(args.model) if args.model in PRESETS else load_config(args.model)
    dtype = _parse_dtype(args.dtype)
    # a 1x1 mesh is a mesh of one device: the same partitioned programs as any other
    precision = attention_precision(args.attention_precision, dtype)
    kernels = dataclasses.replace(kernel_config(args.kernels), dsa_precision=precision)
    model = abstract_model(cfg, dtype=dtype, mesh=args.mesh, kernels=kernels,
                           platform="gpu" if platform in ("cuda", "rocm") else platform)
    chunks = (tuple(int(c) for c in args.prefill_chunk_sizes.split(",")) if args.prefill_chunk_sizes
              else DEFAULT_CHUNKS[platform])
    V = cfg.vocab_size
    runner = ModelRunner(model, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                         prefill_chunk_sizes=chunks, kv_dtype=args.kv_dtype, index_dtype=args.index_dtype,
                         class_masks=np.zeros((class_table_rows(args.max_num_seqs, args.speculative_tokens), V), bool),
                         stop_mask=np.zeros(V, bool),
                         spec_tokens=args.speculative_tokens, dcp=args.dcp,
                         token_split_min_tokens=args.token_split_min_tokens)
    os.makedirs(args.out, exist_ok=True)
    summary = {"platform": platform, "model": args.model, "architecture": cfg.architecture, "mesh": args.mesh,
               "devices": int(model.mesh.size), "kernels": args.kernels, "attention_precision": precision,
               "dtype": jnp.dtype(dtype).name, "kv_dtype": runner.kv_dtype, "index_dtype": runner.index_dtype,
               "max_num_seqs": runner.B, "dcp": runner.dcp,
               "cache_bytes_per_device": runner.cache_bytes_per_device(), "max_cached_tokens": runner.max_cached_tokens,
               "max_model_len": runner.L, "prefill_chunk_sizes": list(runner.chunk_sizes),
               "jax": jax.__version__, "programs": {}}
    wanted = tuple(x.strip() for x in args.programs.split(",")) if args.programs else None
    for name, (fn, fn_args) in runner.program_args().items():
        if wanted is not None and not name.startswith(wanted):
            continue
        t0 = time.perf_counter()
        entry = {"file": f"{name}.jax"}
        try:
            flat_fn, leaves, in_names = _flat_program(fn, fn_args)
            checks = ([jax.export.DisabledSafetyCheck.custom_call(t) for t in GPU_KERNEL_TARGETS]
                      if platform in ("cuda", "rocm") else [])
            exported = jax.export.export(flat_fn, platforms=[platform], disabled_checks=checks)(*leaves)
            blob = exported.serialize()
            _write_atomic(os.path.join(args.out, entry["file"]), bytes(blob))
            text = exported.mlir_module()
            entry.update(ok=True, bytes=len(blob), kernel_calls=kernel_calls(text), kernel_names=kernel_names(text),
                         nr_devices=exported.nr_devices, inputs=in_names)
        except Exception as e:  # noqa: BLE001  (reported per program; the exit status says it failed)
            entry.update(ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:2000])
            log.error("export of %s failed: %s", name, entry["error"])
        entry["seconds"] = round(time.perf_counter() - t0, 2)
        summary["programs"][name] = entry
        log.info("%-14s %s %s", name, "ok" if entry["ok"] else "FAILED", entry.get("kernel_calls", ""))
    summary["ok"] = all(e["ok"] for e in summary["programs"].values())
    _write_atomic(os.path.join(args.out, "summary.json"), json.dumps(summary, indent=2).encode())
    return summary


def _flat_program(fn, args):
    """`fn(*args)` as a function of the argument pytrees' leaves returning its output's leaves, so the exported
    module names no Python type (`jax.export` serializes only registered pytree nodes). Returns (flat function,
    leaves, each leaf's path in the arguments, e.g. "[1].cache.length")."""
    with_paths, in_tree = jax.tree_util.tree_flatten_with_path(args)
    leaves = [leaf for _, leaf in with_paths]

    def flat(*leaves):
        return tuple(jax.tree.leaves(fn(*jax.tree.unflatten(in_tree, leaves))))

    return jax.jit(flat), leaves, [jax.tree_util.keystr(path) for path, _ in with_paths]


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _fake_devices(mesh_spec: str) -> None:
    """On a CPU host, as many CPU devices as the mesh needs (before JAX starts its backend)."""
    sizes = parse_mesh_spec(mesh_spec)
    need = sizes["data"] * sizes["context"] * sizes["model"]
    if need > 1:
        fake_cpu_devices(need)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        _fake_devices(args.mesh)
    except ValueError as e:
        print(f"error: --mesh: {e}", file=sys.stderr)
        return 2
    try:
        summary = export_programs(args)
    except ValueError as e:  # a bad model, dtype, cache format or size: say so, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    bad = [n for n, e in summary["programs"].items() if not e["ok"]]
    print(json.dumps({"ok": summary["ok"], "out": args.out, "failed": bad,
                      "kernel_calls": {n: e.get("kernel_calls", {}) for n, e in summary["programs"].items()}}))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
