"""The conversion plan of a Hugging Face checkpoint directory: config, name map, and every source tensor checked
(present, expected shape and dtype, nothing unexpected left over) before anything is written."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from kimi_jax.config import ModelConfig

from . import archs, quant
from .entries import Entry, resolve
from .errors import ConvertError, listing
from .safetensors_io import SourceSet


@dataclass
class Plan:
    src: str
    hf_config: dict
    cfg: ModelConfig
    sources: SourceSet
    entries: list[Entry]
    shapes: dict  # parameter path -> shape
    fp8_block: tuple

    @property
    def architecture(self) -> str:
        return self.cfg.architecture

    def target_shapes(self, entry: Entry) -> list:
        return [self.shapes[t] for t in entry.targets] if entry.kind != "extra" else []

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
    return quant.FP8_BLOCK


def param_shapes(cfg: ModelConfig, dtype=jnp.float32) -> dict:
    # convert sits below the model (DESIGN.md), yet takes the parameter shapes from the model itself: a known layer
    # exception (issue 44), imported on use so that `import convert` does not load the model
    from kimi_jax.model import abstract_params

    return {k: tuple(v.shape) for k, v in abstract_params(cfg, dtype).items()}


def param_dtypes(cfg: ModelConfig, dtype) -> dict:
    from kimi_jax.model import abstract_params

    return {k: np.dtype(v.dtype) for k, v in abstract_params(cfg, dtype).items()}


def make_plan(src: str, architecture: str = "auto") -> Plan:
    if not os.path.isdir(src):
        raise ConvertError(f"source {src} is not a directory")
    if os.path.isfile(os.path.join(src, "kimi_jax_checkpoint.json")):
        raise ConvertError(f"source {src} is already a converted kimi_jax checkpoint; to write it back as "
                           f"safetensors use --export (python -m convert --export {src} OUT)")
    hf = read_hf_config(src)
    cfg = archs.detect(hf, architecture, where=os.path.join(src, "config.json"))
    sources = SourceSet(src)
    names = set(sources.names())
    entries, is_extra = archs.name_map(cfg, names)
    shapes = param_shapes(cfg)
    produced = [t for e in entries for t in e.targets]
    if sorted(produced) != sorted(shapes):
        raise ConvertError(f"internal: the {cfg.architecture} name map does not cover the model's parameters "
                           f"(extra {listing(set(produced) - set(shapes))}; "
                           f"uncovered {listing(set(shapes) - set(produced))})")
    block = fp8_block_of(hf, os.path.join(src, "config.json"))
    missing, claimed = [], set()
    for e in entries:
        missing += resolve(e, sources, [shapes[t] for t in e.targets], block)
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
    _check_vision(cfg, sources, extras, src)
    for n in extras:
        e = Entry("extra", n, ("extra." + n,))
        resolve(e, sources, [], block)
        entries.append(e)
    return Plan(src, hf, cfg, sources, entries, shapes, block)


def _check_vision(cfg, sources, extras, src: str) -> None:
    """A checkpoint that carries a vision tower carries the whole tower its config describes, in its shapes: checked
    here from the headers, so a damaged one fails before a long conversion rather than at `load_model`. A text-only
    checkpoint (no vision tensor at all) passes."""
    from kimi_jax.modules.vision import VISION_PREFIXES, checkpoint_layout

    found = [n for n in extras if n.startswith(VISION_PREFIXES)]
    if cfg.vision is None or not found:
        return
    layout = checkpoint_layout(cfg.vision)
    problems = []
    missing = sorted(set(layout) - set(found))
    if missing:
        problems.append(f"missing vision tensor(s) {listing(missing)}")
    unknown = sorted(set(found) - set(layout))
    if unknown:
        problems.append(f"vision tensor(s) its vision_config does not describe {listing(unknown)}")
    for n in sorted(set(found) & set(layout)):
        shape = tuple(sources.info(n).shape)
        if shape != layout[n][1]:
            problems.append(f"shape mismatch for {n}: expected {list(layout[n][1])}, found {list(shape)}")
    if problems:
        raise ConvertError(f"{src} does not match its vision_config: " + "; ".join(problems))
