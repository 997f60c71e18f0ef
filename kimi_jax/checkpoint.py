"""Loading checkpoints into a `Model`: a converted kimi_jax directory, or a Hugging Face directory converted on the
fly in memory (no temporary files).

The model is built abstractly (`nnx.eval_shape`, nothing allocated, nothing randomly initialised); each parameter
leaf is then filled from the checkpoint, checked against the abstract shape, cast to the abstract dtype (the model
keeps some parameters in float32 whatever `dtype` says) and placed on its devices one array at a time.

Quantised weights: MXFP4-packed routed experts stay packed (DESIGN.md "No weight copies"): the MoE modules of the
abstract model switch to MXFP4 parameters (`MoE.use_mxfp4_experts`; `layers.L.block_sparse_moe.w1_packed` uint8
`[E, N, K/2]` + `w1_scale` E8M0 uint8 `[E, N, K/32]`, the checkpoint's own layout) and the stored arrays are placed as
they are; the MoE kernels decode them tile by tile. `mxfp4_experts="dequantize"` loads them as plain `dtype` arrays
instead (tests, comparisons). FP8 block weights kept by `--dtype keep` are dequantised here into the plain arrays.

With `mesh`, each parameter is placed as it is filled, with the partition spec of `sharding.mesh_partition_spec`
(the sharding package's rules, routed experts over the mesh's expert axes; a mesh without a "model" axis
replicates), so no host ever holds a second copy.
"""

from __future__ import annotations

import logging
import os
from typing import Iterator, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from convert import store
from convert.entries import build as build_entry, from_json, to_params
from convert.errors import ConvertError, listing
from convert.plan import make_plan
from sharding.context import KernelConfig
from sharding.rules import mesh_partition_spec

from .config import PRESETS, ConfigError, ModelConfig, get_preset, load_config
from .model import Model, _mesh, _parse_dtype, random_model
from .modules.decoder import KimiForCausalLM
from .modules.moe import EXPERT_WEIGHTS, moe_layers
from .modules.vision import VISION_PREFIXES, load_vision_tower

log = logging.getLogger("kimi_jax")


MXFP4_MODES = ("packed", "dequantize")


def preflight(path) -> ModelConfig:
    """Check what can be checked of a checkpoint directory before any weight is read (seconds, where loading takes
    minutes): it is a directory, its config parses, and a converted checkpoint's metadata lists parts that all
    exist (a Hugging Face one: its weight files are indexed, headers only).  Returns the config; raises
    ``ConfigError`` / ``ConvertError`` (both ``ValueError``s) naming the problem."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        raise ConfigError(f"{path!r} is not a checkpoint directory")
    cfg = load_config(path)
    if os.path.isfile(os.path.join(path, store.META_NAME)):
        meta = store.read_meta(path)
        missing = [p for p in meta["parts"] if not os.path.isdir(os.path.join(path, p))]
        if missing:
            raise ConvertError(f"{path}: {len(missing)} of the {len(meta['parts'])} weight parts its "
                               f"{store.META_NAME} lists are missing (first: {missing[0]}); copy or convert it again")
    elif os.path.isfile(os.path.join(path, "config.json")):
        make_plan(path)  # reads the safetensors headers: a missing or unreadable weight file fails here
    return cfg


def load(path, mesh=None, dtype=None, kernels=None, mxfp4_experts: str = "packed"):
    """A converted kimi_jax checkpoint dir or a Hugging Face checkpoint dir -> `Model`.

    dtype: parameter dtype of the model (None: the checkpoint's, i.e. that of its embedding table).
    mesh: None, a `jax.sharding.Mesh` with a "model" axis, or a `--mesh` string such as "8x1".
    kernels: a `KernelConfig` (default: "auto").
    mxfp4_experts: "packed" (default) keeps MXFP4 routed experts packed as model parameters; "dequantize" expands
    them to `dtype` at load time (a full-width copy: for comparisons only).
    """
    if mxfp4_experts not in MXFP4_MODES:
        raise ValueError(f"mxfp4_experts must be one of {MXFP4_MODES}, got {mxfp4_experts!r}")
    keep = mxfp4_experts == "packed"
    path = os.path.abspath(os.fspath(path))  # Orbax reads absolute paths only
    if not os.path.isdir(path):
        raise ConfigError(f"{path!r} is not a checkpoint directory")
    if os.path.isfile(os.path.join(path, store.META_NAME)):
        meta = store.read_meta(path)
        cfg = load_config(path)
        default = np.dtype(meta["param_dtype"])
        packed = _mxfp4_expert_targets(meta["entries"]) if keep else set()
        arrays = lambda shapes, dtypes: _converted_arrays(path, meta, shapes, dtypes, packed)
        vision = lambda: _converted_vision(path, meta)
    elif os.path.isdir(os.path.join(path, store.PARAMS_DIR)) and not any(
            f.endswith(".safetensors") for f in os.listdir(path)):
        raise ConvertError(f"{path} looks like a kimi_jax checkpoint (it has {store.PARAMS_DIR}/) but its "
                           f"{store.META_NAME} is missing: a damaged or unfinished copy; convert the source again")
    elif os.path.isfile(os.path.join(path, "config.json")):
        plan = make_plan(path)
        cfg = plan.cfg
        embed = next(e for e in plan.entries if e.targets == ("embed_tokens",))
        default = plan.sources.info(embed.src).np_dtype
        packed = _mxfp4_expert_targets(plan.entries) if keep else set()
        arrays = lambda shapes, dtypes: _hf_arrays(plan, dtypes, packed)
        vision = lambda: _hf_vision(plan)
    else:
        raise ConvertError(f"{path} holds neither a kimi_jax checkpoint ({store.META_NAME}) nor a Hugging Face "
                           f"checkpoint (config.json)")
    dtype = jnp.dtype(dtype) if dtype is not None else jnp.dtype(default)
    model = assemble(cfg, arrays, dtype=dtype, mesh=mesh, kernels=kernels, where=path, mxfp4_experts=packed)
    if cfg.vision is not None:
        tensors = vision()
        if tensors:
            model.vision = load_vision_tower(tensors, cfg.vision, dtype=dtype)
            log.info("vision tower loaded (%d tensors): the model takes images", len(tensors))
        else:
            log.info("%s: the config has a vision tower but the checkpoint holds none of its tensors: text only", path)
    return model


def load_model(path_or_preset: str, *, mesh=None, dtype=None, seed: int = 0,
               kernels: Optional[KernelConfig] = None) -> Model:
    """A preset name (random weights), a converted kimi_jax checkpoint dir, or a Hugging Face checkpoint dir.

    `mesh`: a `jax.sharding.Mesh` with axes ("data", "model"), or a `--mesh` string such as "8x1"; parameters are
    placed by `sharding.rules` (heads, experts and vocab over "model"). `kernels`: which kernel implementation each
    op family runs (`KernelConfig`; default "auto": Pallas kernels on TPU/GPU, the jnp reference on CPU).
    `dtype`: parameter / activation dtype — a JAX dtype or a name ("bf16", "fp32", "bfloat16", "float32", ...);
    None keeps the checkpoint's (float32 for presets).
    """
    dtype = _parse_dtype(dtype)
    if path_or_preset in PRESETS:
        return random_model(get_preset(path_or_preset), seed=seed, dtype=dtype or jnp.float32, mesh=mesh,
                            kernels=kernels)
    if not os.path.isdir(path_or_preset):
        load_config(path_or_preset)  # raises a clear ConfigError
    return load(path_or_preset, mesh=mesh, dtype=dtype, kernels=kernels)


def _is_vision(name: str) -> bool:
    return name.removeprefix("extra.").startswith(VISION_PREFIXES)


def _converted_vision(path, meta) -> dict:
    """The vision tower's tensors of a converted checkpoint (carried as `extra.<HF name>` entries), by HF name."""
    reader = store.PartReader(path, meta["parts"])
    out = {}
    for entry in (from_json(e) for e in meta["entries"]):
        if entry.kind == "extra" and _is_vision(entry.src):
            part = reader.get(entry.extra["part"])
            out[entry.src] = np.asarray(part[entry.targets[0]])
    return out


def _hf_vision(plan) -> dict:
    """The vision tower's tensors of a Hugging Face checkpoint, by name."""
    out = {}
    for entry in plan.entries:
        if entry.kind == "extra" and _is_vision(entry.src):
            arrays, _ = build_entry(entry, plan.sources, [], dtypes=[None], keep_quant=False, fp8_block=plan.fp8_block)
            out[entry.src] = arrays[entry.targets[0]]
    return out


def _mxfp4_expert_targets(entries) -> set:
    """Parameter paths (`layers.L.block_sparse_moe.w1`) of routed-expert entries stored / found as MXFP4."""
    out = set()
    for e in entries:
        kind, form, targets = (e["kind"], e["form"], e["targets"]) if isinstance(e, dict) else (e.kind, e.form,
                                                                                                 e.targets)
        if kind == "experts" and form == "mxfp4":
            out.add(targets[0])
    # whole MoE layers only: a layer with some experts' weights plain keeps plain arrays (the MXFP4 ones dequantised)
    prefixes = {t.rsplit(".", 1)[0] for t in out}
    whole = {p for p in prefixes if all(f"{p}.{w}" in out for w in EXPERT_WEIGHTS)}
    return {t for t in out if t.rsplit(".", 1)[0] in whole}


def _packed_modules(module, targets: set) -> set:
    """Switch every MoE module whose three expert weights are all in `targets` to MXFP4 parameters (see
    `MoE.use_mxfp4_experts`). Returns the expert targets that were switched."""
    switched = set()
    for path, m in moe_layers(module):
        prefix = ".".join(str(p) for p in path)
        names = {f"{prefix}.{w}" for w in EXPERT_WEIGHTS}
        if names <= targets:
            m.use_mxfp4_experts()
            switched |= names
    return switched


def assemble(cfg: ModelConfig, arrays, *, dtype, mesh=None, kernels=None, where: str = "checkpoint",
             mxfp4_experts=frozenset()):
    """Build the model abstractly and fill its parameters from `arrays(shapes, dtypes)`, an iterator of
    (parameter path, numpy array). `mxfp4_experts`: expert parameter paths whose MoE modules hold MXFP4
    parameters (`<path>_packed`, `<path>_scale`) instead of the plain array; the iterator yields those names."""
    mesh = _mesh(mesh)
    kernels = kernels or KernelConfig()

    def build():
        m = KimiForCausalLM(cfg, rngs=nnx.Rngs(0), dtype=dtype)
        if mxfp4_experts:
            switched = _packed_modules(m, set(mxfp4_experts))
            if switched != set(mxfp4_experts):
                raise ConvertError(f"{where}: MXFP4 experts {sorted(set(mxfp4_experts) - switched)[:3]} are not "
                                   "the w1/w3/w2 of MoE layers of this model")
        return m

    abstract = nnx.eval_shape(build)
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    if jax.tree_util.tree_leaves(rest):
        raise ConfigError("internal: the model holds non-parameter state that a checkpoint cannot fill")
    leaves = {_path_name(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
    shapes = {k: tuple(v.shape) for k, v in leaves.items()}
    dtypes = {k: np.dtype(v.dtype) for k, v in leaves.items()}
    filled = {}
    for name, arr in arrays(shapes, dtypes):
        if name not in leaves:
            raise ConvertError(f"{where}: array {name} is not a parameter of the {cfg.architecture} model")
        if name in filled:
            raise ConvertError(f"{where}: parameter {name} appears twice")
        if tuple(arr.shape) != shapes[name]:
            raise ConvertError(f"{where}: shape mismatch for {name}: expected {list(shapes[name])}, "
                               f"found {list(arr.shape)}")
        arr = np.asarray(arr).astype(dtypes[name], copy=False)
        filled[name] = jax.device_put(arr, _sharding(name, arr.shape, mesh))
        del arr
    missing = sorted(set(leaves) - set(filled))
    if missing:
        raise ConvertError(f"{where}: checkpoint lacks parameter(s) {listing(missing)}")
    params = jax.tree_util.tree_map_with_path(lambda p, _: filled[_path_name(p)], params)
    module = nnx.merge(graphdef, params, rest)
    # the module now holds the only references to the arrays: whatever Model re-lays at load (MXFP4 experts on a
    # GPU, `MoE.use_mosaic_experts`) frees each old array as its replacement is made, not all of them at the end
    del filled, params
    return Model(module, dtype, mesh=mesh, kernels=kernels)  # Model re-applies sharding.rules: a no-op for arrays placed here


def _path_name(path) -> str:
    parts = (str(getattr(p, "key", getattr(p, "idx", getattr(p, "name", "")))) for p in path)
    return ".".join(x for x in parts if x and x != "value")


def _sharding(name, shape, mesh) -> Optional[jax.sharding.Sharding]:
    if mesh is None:
        return None
    # the mesh's own expert axes too: with experts over ("context", "model") (`expert=8,tensor=1,context=8`) a
    # "model"-only spec would first put every expert on every device
    return NamedSharding(mesh, mesh_partition_spec(name, shape, mesh))


def _as_u8(a) -> np.ndarray:
    """E8M0 scales may be stored as float8_e8m0fnu: keep the bits (a value cast would change them)."""
    a = np.asarray(a)
    return a if a.dtype == np.uint8 else a.view(np.uint8)


def _converted_arrays(path, meta, shapes, dtypes, packed=frozenset()) -> Iterator[tuple[str, np.ndarray]]:
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
        if entry.form == "mxfp4" and entry.targets[0] in packed:  # stored in the HF layout = the parameter layout
            yield from ((n, _as_u8(stored[n])) for n in entry.stored_quant_names())
            continue
        try:
            tshapes = [shapes[t] for t in entry.targets]
        except KeyError as e:
            raise ConvertError(f"{path}: array {e.args[0]} is not a parameter of this model") from None
        out = to_params(entry, stored, tshapes, [dtypes[t] for t in entry.targets], block)
        yield from out.items()


def _hf_arrays(plan, dtypes, packed=frozenset()) -> Iterator[tuple[str, np.ndarray]]:
    for entry in plan.entries:
        if entry.kind == "extra":
            continue
        keep = entry.form == "mxfp4" and entry.targets[0] in packed
        arrays, _ = build_entry(entry, plan.sources, plan.target_shapes(entry),
                          dtypes=[dtypes.get(t) for t in entry.targets], keep_quant=keep, fp8_block=plan.fp8_block)
        yield from ((n, _as_u8(a) if keep else a) for n, a in arrays.items())
