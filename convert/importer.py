"""Hugging Face safetensors -> kimi_jax checkpoint (`python -m convert SRC DST`)."""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any, Callable

import jax.numpy as jnp
import numpy as np

from kimi_jax.config import ModelConfig

from . import interrupt, store
from .entries import build, to_json
from .errors import ConvertError
from .tensor_plan import Targets, TensorPlan, make_tensor_plan, open_source
from .safetensors_io import DTYPES, dtype_name

DTYPE_POLICIES = ("bf16", "fp8", "keep")
log = logging.getLogger("convert")


def convert(src: str, dst: str, targets_for: Callable[[ModelConfig, Any], Targets], *, dtype: str = "keep",
            architecture: str = "auto", overwrite: bool = False, progress: bool = True,
            part_bytes: int = store.DEFAULT_PART_BYTES) -> dict:
    """Convert the Hugging Face checkpoint directory `src` into a kimi_jax checkpoint at `dst`.

    targets_for(cfg, dtype): the `Targets` every tensor is checked against — the parameter shapes and dtypes of the
    model of `cfg` in `dtype` (bfloat16 is asked for) — from the layer above: `kimi_jax.checkpoint.model_targets`,
    which `python -m convert` and `kimi_jax.checkpoint.convert_checkpoint` pass.

    dtype: "keep" (default) keeps every tensor's dtype and FP8 weights quantised (lossless: `export` writes the
    same safetensors back); "bf16" casts floating weights to the dtypes of a bfloat16 model (parameters the model
    keeps in float32 — A_log, dt_bias, conv taps, o_norm, router, correction bias — stay float32) and dequantises FP8
    block weights; "fp8" additionally stores plain projection / expert weights as FP8 e4m3 with 128x128 scales.
    MXFP4 experts stay packed in every mode. Returns a summary dict (architecture, tensors, bytes, seconds, parts).
    """
    if dtype not in DTYPE_POLICIES:
        raise ConvertError(f"unknown --dtype {dtype!r}; choose one of {', '.join(DTYPE_POLICIES)}")
    src, dst = os.path.abspath(src), os.path.abspath(dst)
    store.check_destination(dst, overwrite, sources=[src])
    t0 = time.time()
    source = open_source(src, architecture)
    plan = make_tensor_plan(source, targets_for(source.cfg, jnp.bfloat16))
    log.info("%s: %s, %d tensors in %d file(s), %.2f GiB", src, plan.architecture, len(plan.sources.tensors),
             len(plan.sources.files), plan.sources.total_bytes / 2**30)
    with store.atomic_directory(dst, overwrite) as tmp:
        summary = _write(plan, tmp, dtype, progress, part_bytes)
    summary.update(seconds=time.time() - t0, dst=dst)
    log.info("wrote %s: %d arrays in %d part(s), %.2f GiB in %.1f s", dst, summary["arrays"], summary["parts"],
             summary["bytes_written"] / 2**30, summary["seconds"])
    return summary


def _write(plan: TensorPlan, tmp: str, policy: str, progress: bool, part_bytes: int) -> dict:
    from tqdm import tqdm

    dtypes = {t: plan.targets.dtype(t) for t in plan.targets.params} if policy != "keep" else {}
    writer = store.PartWriter(tmp, part_bytes)
    records = []
    total = sum(plan.entry_bytes(e) for e in plan.entries)
    n_tensors = len(plan.sources.tensors)
    done_tensors = 0
    written = 0
    arrays_count = 0
    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="convert", disable=not progress,
               dynamic_ncols=True)
    try:
        for entry in plan.entries:
            interrupt.check()
            src_form = entry.form
            keep_quant = entry.form == "mxfp4" or (entry.form == "fp8" and policy in ("keep", "fp8"))
            requant = policy == "fp8" and entry.quantizable and entry.form == "plain"
            writer.reserve(_estimate(plan, entry, dtypes, keep_quant or requant))
            arrays, form = build(entry, plan.sources, plan.target_shapes(entry),
                                 dtypes=[dtypes.get(t) for t in entry.targets] if entry.kind != "extra" else [None],
                                 keep_quant=keep_quant, requant=requant, fp8_block=plan.fp8_block)
            entry.form = form
            part = writer.add(arrays)
            entry.extra = {"part": part, "src_form": src_form,
                           "arrays": {n: [dtype_name(a.dtype), list(a.shape)] for n, a in arrays.items()}}
            records.append(to_json(entry))
            written += sum(a.nbytes for a in arrays.values())
            arrays_count += len(arrays)
            del arrays
            done_tensors += len(entry.all_src_names(src_form))
            bar.update(_src_bytes(plan, entry, src_form))
            bar.set_postfix_str(f"tensors {done_tensors}/{n_tensors}", refresh=False)
        parts = writer.close()
    finally:
        bar.close()
    embed = next(r for r in records if r["targets"] == ["embed_tokens"])
    meta = {
        "format": store.FORMAT,
        "version": store.FORMAT_VERSION,
        "architecture": plan.architecture,
        "dtype_policy": policy,
        "param_dtype": np.dtype(_np_dtype(embed["extra"]["arrays"]["embed_tokens"][0])).name,
        "fp8_block": list(plan.fp8_block),
        "source": {"dir": plan.src, "files": [os.path.basename(f) for f in plan.sources.files],
                   "tensors": n_tensors, "bytes": plan.sources.total_bytes},
        "parts": parts,
        "entries": records,
    }
    copied = store.copy_side_files(plan.src, tmp)
    meta["hf_files"] = copied
    with open(os.path.join(tmp, store.CONFIG_NAME), "w") as f:
        f.write(plan.cfg.to_json())
    with open(os.path.join(tmp, store.META_NAME), "w") as f:
        json.dump(meta, f, indent=0)
    return {"architecture": plan.architecture, "tensors": n_tensors, "bytes_read": total, "bytes_written": written,
            "arrays": arrays_count, "parts": len(parts)}


def _estimate(plan: TensorPlan, entry, dtypes, quantised: bool) -> int:
    """Bytes the entry's stored arrays will take (before building them)."""
    if quantised or entry.kind == "extra":
        return plan.entry_bytes(entry)
    itemsize = plan.sources.info(entry.all_src_names()[0]).np_dtype.itemsize if entry.form == "plain" else 4
    return sum(int(np.prod(plan.targets.shape(t))) * (dtypes[t].itemsize if t in dtypes else itemsize)
               for t in entry.targets)


def _src_bytes(plan: TensorPlan, entry, form) -> int:
    return sum(plan.sources.info(n).nbytes for n in entry.all_src_names(form))


def _np_dtype(name: str):
    return DTYPES[name]
