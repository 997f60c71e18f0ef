"""The tensor plan of a Hugging Face checkpoint directory: which source tensors make which target arrays, with every
source tensor checked — present, expected shape and dtype, nothing unexpected left over — before any is read.

Two steps, because what the tensors must fit comes from the layer above (the model), which needs the config first:

    source = open_source(src)                     # config.json, the safetensors headers, the architecture's name map
    plan = make_tensor_plan(source, targets)      # `Targets`: the model's parameter shapes (and dtypes)

convert never builds the model: `targets` are given (`kimi_jax.checkpoint.model_targets` for Kimi models).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from kimi_jax.config import ModelConfig

from pallas_kernels import codec

from . import archs
from .entries import Entry, resolve
from .errors import ConvertError, listing
from .safetensors_io import SourceSet


@dataclass(frozen=True)
class Targets:
    """What the converted tensors must fit.

    params: parameter path ("layers.3.self_attn.q_b_proj.kernel") -> its shape and dtype (anything with `.shape`
    and `.dtype`, e.g. a `jax.ShapeDtypeStruct`), every parameter of the model, routed experts in their plain
    `[E, K, N]` shape whatever the source's format. The dtypes are those a checkpoint converted to that dtype holds
    (some parameters stay float32 in a bfloat16 model).
    carried: per group of tensors carried through untouched and checked as a whole (e.g. "vision": the vision
    tower), source name -> shape: a source holding any tensor under one of a group's top-level prefixes
    ("vision_tower.", "mm_projector.") holds exactly that group's tensors.
    """

    params: Mapping[str, Any]
    carried: Mapping[str, Mapping[str, tuple]] = field(default_factory=dict)

    def shape(self, name: str) -> tuple:
        return tuple(self.params[name].shape)

    def dtype(self, name: str) -> np.dtype:
        return np.dtype(self.params[name].dtype)


@dataclass(frozen=True)
class Source:
    """A Hugging Face checkpoint directory, opened: its config, the headers of its tensors, and the name map of its
    architecture (entries not yet checked against any target)."""

    src: str
    hf_config: dict
    cfg: ModelConfig
    sources: SourceSet
    fp8_block: tuple

    @property
    def architecture(self) -> str:
        return self.cfg.architecture

    def source_dtype(self, target: str) -> np.dtype:
        """The dtype of the source tensor that makes parameter `target` (e.g. "embed_tokens": a checkpoint's
        own dtype)."""
        entries, _ = archs.name_map(self.cfg, set(self.sources.names()))
        entry = next((e for e in entries if target in e.targets), None)
        if entry is None:
            raise ConvertError(f"internal: no {self.architecture} entry makes {target}")
        name = entry.src_name(0)
        if name not in self.sources:
            raise ConvertError(f"{self.src} does not match its {self.architecture} config.json: missing tensor(s) "
                               f"{name}")
        return self.sources.info(name).np_dtype


@dataclass(frozen=True)
class TensorPlan:
    """A `Source` checked against `Targets`: one resolved `Entry` per source tensor (or stack of per-expert tensors),
    its form (plain, fp8, mxfp4) detected, plus the tensors carried through (`kind` "extra")."""

    source: Source
    targets: Targets
    entries: list

    @property
    def src(self) -> str:
        return self.source.src

    @property
    def cfg(self) -> ModelConfig:
        return self.source.cfg

    @property
    def sources(self) -> SourceSet:
        return self.source.sources

    @property
    def fp8_block(self) -> tuple:
        return self.source.fp8_block

    @property
    def architecture(self) -> str:
        return self.source.architecture

    def target_shapes(self, entry: Entry) -> list:
        return [self.targets.shape(t) for t in entry.targets] if entry.kind != "extra" else []

    def entry_bytes(self, entry: Entry) -> int:
        return sum(self.sources.info(n).nbytes for n in entry.all_src_names())


def read_hf_config(src: str) -> dict:
    path = os.path.join(src, "config.json")
    if not os.path.isfile(path):
        raise ConvertError(f"{src} has no config.json (expected a Hugging Face checkpoint directory)")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ConvertError(f"{path} is not valid JSON ({e})") from None


def fp8_block_of(hf: dict, where: str = "config.json") -> tuple:
    for d in (hf, hf.get("text_config") or {}):
        qc = d.get("quantization_config") or {}
        if isinstance(qc, dict) and qc.get("weight_block_size"):
            b = qc["weight_block_size"]
            if not (isinstance(b, list) and len(b) == 2 and all(type(x) is int and x > 0 for x in b)):
                raise ConvertError(f"{where}: quantization_config.weight_block_size must be two positive integers "
                                   f"such as [128, 128], found {b!r}")
            return (b[0], b[1])
    return codec.FP8_BLOCK


def open_source(src: str, architecture: str = "auto") -> Source:
    """Read `src`'s config.json (its architecture detected; `architecture` other than "auto" must agree) and the
    headers of its safetensors files. Nothing but headers is read."""
    if not os.path.isdir(src):
        raise ConvertError(f"source {src} is not a directory")
    if os.path.isfile(os.path.join(src, "kimi_jax_checkpoint.json")):
        raise ConvertError(f"source {src} is already a converted kimi_jax checkpoint; to write it back as "
                           f"safetensors use --export (python -m convert --export {src} OUT)")
    hf = read_hf_config(src)
    where = os.path.join(src, "config.json")
    cfg = archs.detect(hf, architecture, where=where)
    block = fp8_block_of(hf, where)
    return Source(src, hf, cfg, SourceSet(src), block)


def make_tensor_plan(source: Source, targets: Targets) -> TensorPlan:
    """Check every tensor of `source` against `targets` and plan each target's making. Raises `ConvertError`
    listing what is missing, unexpected or mismatched."""
    src, cfg, sources = source.src, source.cfg, source.sources
    names = set(sources.names())
    entries, is_extra = archs.name_map(cfg, names)
    produced = [t for e in entries for t in e.targets]
    if sorted(produced) != sorted(targets.params):
        raise ConvertError(f"internal: the {cfg.architecture} name map does not cover the model's parameters "
                           f"(extra {listing(set(produced) - set(targets.params))}; "
                           f"uncovered {listing(set(targets.params) - set(produced))})")
    missing, claimed = [], set()
    for e in entries:
        missing += resolve(e, sources, [targets.shape(t) for t in e.targets], source.fp8_block)
        claimed.update(n for n in e.all_src_names() if n in names)
    leftover = names - claimed
    extras = sorted(n for n in leftover if is_extra(n))
    unexpected = sorted(leftover - set(extras))
    problems = []
    if missing:
        problems.append(f"missing tensor(s) {listing(missing)}")
    if unexpected:
        problems.append(f"unexpected tensor(s) {listing(unexpected)}")
    if problems:
        raise ConvertError(f"{src} does not match its {cfg.architecture} config.json: " + "; ".join(problems))
    for group, tensors in targets.carried.items():
        _check_carried(group, tensors, sources, extras, src)
    for n in extras:
        e = Entry("extra", n, ("extra." + n,))
        resolve(e, sources, [], source.fp8_block)
        entries.append(e)
    return TensorPlan(source, targets, entries)


def _prefix(name: str) -> str:
    return name.split(".", 1)[0] + "."


def _check_carried(group: str, carried: Mapping[str, tuple], sources, extras, src: str) -> None:
    """A source that carries any tensor under the top-level prefixes of `carried` (the vision tower's
    `vision_tower.`, `mm_projector.`) carries all of `carried`, in their shapes, and nothing else under those
    prefixes: checked here from the headers, so a damaged tower fails before a long conversion rather than at load.
    A source with none of them (a text-only checkpoint) passes."""
    prefixes = tuple(sorted({_prefix(n) for n in carried}))
    found = [n for n in extras if n.startswith(prefixes)] if prefixes else []
    if not found:
        return
    problems = []
    missing = sorted(set(carried) - set(found))
    if missing:
        problems.append(f"missing {group} tensor(s) {listing(missing)}")
    unknown = sorted(set(found) - set(carried))
    if unknown:
        problems.append(f"{group} tensor(s) its {group}_config does not describe {listing(unknown)}")
    for n in sorted(set(found) & set(carried)):
        shape = tuple(sources.info(n).shape)
        if shape != tuple(carried[n]):
            problems.append(f"shape mismatch for {n}: expected {list(carried[n])}, found {list(shape)}")
    if problems:
        raise ConvertError(f"{src} does not match its {group}_config: " + "; ".join(problems))
