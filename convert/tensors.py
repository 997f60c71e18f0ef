"""Tensors by target name, for a loader: from a converted kimi_jax checkpoint or from the `TensorPlan` of a Hugging
Face directory (converted in memory, tensor by tensor; no temporary files).

Each iterator yields `(parameter path, value)` in checkpoint order, one entry's arrays at a time. A value is a NumPy
array in the parameter's layout and the dtype asked for, except for the routed experts named in `keep_mxfp4`, whose
value is the source's own MXFP4 pair `(packed uint8 [E, N, K/2], E8M0 scale uint8 [E, N, K/32])`, the checkpoint's
`[out, in]` layout, never dequantised. FP8 block weights (kept by `--dtype keep`) are dequantised.
"""

from __future__ import annotations

from typing import Iterator, Mapping

import numpy as np

from . import store
from .entries import build, from_json, to_params
from .errors import ConvertError
from .tensor_plan import TensorPlan


def mxfp4_targets(entries) -> set:
    """Parameter paths of the routed-expert entries (`Entry`s or their JSON records) stored / found as MXFP4."""
    out = set()
    for e in entries:
        kind, form, targets = (e["kind"], e["form"], e["targets"]) if isinstance(e, dict) else (e.kind, e.form,
                                                                                                 e.targets)
        if kind == "experts" and form == "mxfp4":
            out.add(targets[0])
    return out


def _as_u8(a) -> np.ndarray:
    """E8M0 scales may be stored as float8_e8m0fnu: keep the bits (a value cast would change them)."""
    a = np.asarray(a)
    return a if a.dtype == np.uint8 else a.view(np.uint8)


def hf_tensors(plan: TensorPlan, dtypes: Mapping[str, np.dtype],
               keep_mxfp4=frozenset()) -> Iterator[tuple[str, object]]:
    """The parameters of a Hugging Face directory, read through its plan. `dtypes`: parameter path -> dtype."""
    for entry in plan.entries:
        if entry.kind == "extra":
            continue
        keep = entry.form == "mxfp4" and entry.targets[0] in keep_mxfp4
        arrays, _ = build(entry, plan.sources, plan.target_shapes(entry), dtypes=[dtypes[t] for t in entry.targets],
                          keep_quant=keep, fp8_block=plan.fp8_block)
        if keep:
            yield entry.targets[0], tuple(_as_u8(arrays[n]) for n in entry.stored_quant_names())
        else:
            yield from arrays.items()


def converted_tensors(path: str, meta: dict, targets: Mapping[str, object],
                      keep_mxfp4=frozenset()) -> Iterator[tuple[str, object]]:
    """The parameters of the converted checkpoint at `path` (`meta`: its `store.read_meta`). `targets`: parameter
    path -> the shape and dtype wanted (anything with `.shape` and `.dtype`)."""
    entries = [from_json(e) for e in meta["entries"]]
    reader = store.PartReader(path, meta["parts"])
    block = tuple(meta.get("fp8_block", (128, 128)))
    for entry in sorted((e for e in entries if e.kind != "extra"), key=lambda e: e.extra["part"]):
        part = reader.get(entry.extra["part"])
        stored = {}
        for n in entry.extra["arrays"]:
            if n not in part:
                raise ConvertError(f"{path}: array {n} is missing from {meta['parts'][entry.extra['part']]}")
            stored[n] = part[n]
        if entry.form == "mxfp4" and entry.targets[0] in keep_mxfp4:  # stored in the HF layout = the kernels'
            yield entry.targets[0], tuple(_as_u8(stored[n]) for n in entry.stored_quant_names())
            continue
        try:
            want = [targets[t] for t in entry.targets]
        except KeyError as e:
            raise ConvertError(f"{path}: array {e.args[0]} is not a parameter of this model") from None
        out = to_params(entry, stored, [tuple(w.shape) for w in want], [np.dtype(w.dtype) for w in want], block)
        yield from out.items()


def hf_carried(plan: TensorPlan, select) -> dict:
    """The carried-through tensors of a Hugging Face directory whose names `select(name)` accepts, by name."""
    out = {}
    for entry in plan.entries:
        if entry.kind == "extra" and select(entry.src):
            arrays, _ = build(entry, plan.sources, [], dtypes=[None], keep_quant=False, fp8_block=plan.fp8_block)
            out[entry.src] = arrays[entry.targets[0]]
    return out


def converted_carried(path: str, meta: dict, select) -> dict:
    """The carried-through tensors (stored as `extra.<name>`) of a converted checkpoint whose original names
    `select(name)` accepts, by original name."""
    reader = store.PartReader(path, meta["parts"])
    out = {}
    for entry in (from_json(e) for e in meta["entries"]):
        if entry.kind == "extra" and select(entry.src):
            part = reader.get(entry.extra["part"])
            out[entry.src] = np.asarray(part[entry.targets[0]])
    return out
