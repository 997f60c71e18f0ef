"""Loading checkpoints into a `Model`: a converted kimi_jax directory, or a Hugging Face directory converted on the
fly in memory (no temporary files). The loader sits above the model and the converter below it:

1. the model is built once, abstractly (`model.abstract_module`: nothing allocated, nothing randomly initialised);
2. its parameter shapes and dtypes are what convert checks the source against (`model_targets`,
   `convert.tensor_plan`) and converts each tensor to (`convert.tensors`), tensor by tensor;
3. each parameter is checked against its abstract shape, cast to its abstract dtype (the model keeps some parameters
   in float32 whatever `dtype` says) and placed on its devices once, as it arrives;
4. the routed experts are laid out once for the platform's MoE kernels (`modules.moe.prepare_experts`).

Quantised weights: MXFP4-packed routed experts stay packed (a bf16 copy would take about 3.8 times their bytes): a
MoE layer whose three expert weights the checkpoint holds as MXFP4 holds `MXFP4Experts` (`pallas_kernels.moe.experts`;
packed uint8 `[E, N, K/2]` + E8M0 scale uint8 `[E, N, K/32]`, the checkpoint's own layout), placed as they are; the
MoE kernels decode them tile by tile. `mxfp4_experts="dequantize"` loads them as plain `dtype` arrays instead (tests,
comparisons). FP8 block weights kept by `--dtype keep` are dequantised here into the plain arrays.

With `mesh`, each parameter is placed as it is filled, with the partition spec of `sharding.mesh_partition_spec`
(the sharding package's rules, routed experts over the mesh's expert axes; a mesh without a "model" axis
replicates), so no host ever holds a second copy.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Iterator, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from convert import store
from convert.errors import ConvertError, listing
from convert.importer import convert as convert_with_targets
from convert.tensor_plan import Targets, make_tensor_plan, open_source
from convert.tensors import converted_carried, converted_tensors, hf_carried, hf_tensors, mxfp4_targets
from pallas_kernels.moe.experts import MXFP4Experts
from pallas_kernels.moe.mxfp4 import MXFP4Weight
from sharding.context import KernelConfig
from sharding.rules import mesh_partition_spec, path_name

from .config import PRESETS, ConfigError, ModelConfig, get_preset, load_config
from .model import Model, _flat, _mesh, _parse_dtype, abstract_module, is_routed_expert, random_model
from .modules.decoder import DecoderLayer, KimiForCausalLM
from .modules.moe import moe_layers, prepare_experts
from .modules.vision import VISION_PREFIXES, checkpoint_layout, load_vision_tower

log = logging.getLogger("kimi_jax")


MXFP4_MODES = ("packed", "dequantize")


def model_targets(cfg: ModelConfig, dtype=jnp.float32) -> Targets:
    """What a checkpoint of `cfg` must hold, for convert: every parameter's shape and dtype in a `dtype` model
    (routed experts plain) and, with a vision tower in the config, the tower's tensors in the checkpoint's naming."""
    return _targets(abstract_module(cfg, dtype))


def convert_checkpoint(src, dst, **kw) -> dict:
    """`convert.importer.convert` against this model's targets (what `python -m convert SRC DST` runs); keyword
    arguments as there (dtype, architecture, overwrite, progress, part_bytes)."""
    return convert_with_targets(os.fspath(src), os.fspath(dst), model_targets, **kw)


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
        open_source(path)  # reads the safetensors headers: a missing or unreadable weight file fails here
    return cfg


def load(path, mesh=None, dtype=None, kernels=None, mxfp4_experts: str = "packed",
         platform: Optional[str] = None) -> Model:
    """A converted kimi_jax checkpoint dir or a Hugging Face checkpoint dir -> `Model`.

    dtype: parameter dtype of the model (None: the checkpoint's, i.e. that of its embedding table).
    mesh: None, a `jax.sharding.Mesh` with a "model" axis, or a `--mesh` string such as "8x1".
    kernels: a `KernelConfig` (default: "auto").
    mxfp4_experts: "packed" (default) keeps MXFP4 routed experts packed as model parameters; "dequantize" expands
    them to `dtype` at load time (a full-width copy: for comparisons only).
    platform: the platform whose kernels the routed experts are laid out for and "auto" kernels resolve against
    (None: this host's).
    """
    if mxfp4_experts not in MXFP4_MODES:
        raise ValueError(f"mxfp4_experts must be one of {MXFP4_MODES}, got {mxfp4_experts!r}")
    kernels = kernels or KernelConfig()
    path = os.path.abspath(os.fspath(path))  # Orbax reads absolute paths only
    if not os.path.isdir(path):
        raise ConfigError(f"{path!r} is not a checkpoint directory")
    if os.path.isfile(os.path.join(path, store.META_NAME)):
        meta = store.read_meta(path)
        cfg = load_config(path)
        dtype = jnp.dtype(dtype if dtype is not None else meta["param_dtype"])
        module = abstract_module(cfg, dtype)
        targets = _targets(module)
        packed = _packed_experts(module, mxfp4_targets(meta["entries"])) if mxfp4_experts == "packed" else set()
        tensors = converted_tensors(path, meta, targets.params, packed)
        vision = lambda: converted_carried(path, meta, _is_vision)
    elif os.path.isdir(os.path.join(path, store.PARAMS_DIR)) and not any(
            f.endswith(".safetensors") for f in os.listdir(path)):
        raise ConvertError(f"{path} looks like a kimi_jax checkpoint (it has {store.PARAMS_DIR}/) but its "
                           f"{store.META_NAME} is missing: a damaged or unfinished copy; convert the source again")
    elif os.path.isfile(os.path.join(path, "config.json")):
        source = open_source(path)
        cfg = source.cfg
        dtype = jnp.dtype(dtype if dtype is not None else source.source_dtype("embed_tokens"))
        module = abstract_module(cfg, dtype)
        targets = _targets(module)
        plan = make_tensor_plan(source, targets)
        packed = _packed_experts(module, mxfp4_targets(plan.entries)) if mxfp4_experts == "packed" else set()
        tensors = hf_tensors(plan, {t: targets.dtype(t) for t in targets.params}, packed)
        vision = lambda: hf_carried(plan, _is_vision)
    else:
        raise ConvertError(f"{path} holds neither a kimi_jax checkpoint ({store.META_NAME}) nor a Hugging Face "
                           f"checkpoint (config.json)")
    mesh = _mesh(mesh)
    _fill(module, tensors, mesh=mesh, where=path)
    prepare_experts(module, kernels, platform)
    model = Model(module, dtype, mesh=mesh, kernels=kernels, platform=platform)
    if cfg.vision is not None:
        found = vision()
        if found:
            model.vision = load_vision_tower(found, cfg.vision, dtype=dtype)
            log.info("vision tower loaded (%d tensors): the model takes images", len(found))
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


def _targets(module) -> Targets:
    """`model_targets` of an abstract module already built (the loader builds the model once)."""
    cfg = module.cfg
    carried = {}
    if cfg.vision is not None:
        carried["vision"] = {name: shape for name, (_, shape, _) in checkpoint_layout(cfg.vision).items()}
    return Targets(_flat(nnx.state(module, nnx.Param)), carried)


def _is_vision(name: str) -> bool:
    return name.startswith(VISION_PREFIXES)


def _packed_experts(module, mxfp4: set) -> set:
    """Give every MoE layer of the abstract `module` whose three expert weights are all in `mxfp4` (parameter paths
    of weights the checkpoint holds as MXFP4) the `MXFP4Experts` format. A layer with only some of them MXFP4 keeps
    plain experts (the MXFP4 ones dequantised). Returns the expert paths that stay packed."""
    kept = set()
    for path, m in moe_layers(module):
        prefix = ".".join(str(p) for p in path) + ".experts."
        names = {prefix + w for w in ("gate", "up", "down")}
        if names <= mxfp4:
            m.set_experts(MXFP4Experts.like(m.expert_weights()))
            kept |= names
    return kept


def _fill(module, tensors: Iterator[tuple[str, object]], *, mesh, where: str) -> None:
    """Fill the abstract `module`'s parameters, in place, from `tensors` ((parameter path, NumPy array) pairs, or
    (routed-expert path, (packed, scale)) for experts held as MXFP4), each checked against its abstract shape, cast
    to its abstract dtype and placed on `mesh` as it arrives. Every parameter must be filled exactly once."""
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    if jax.tree_util.tree_leaves(rest):
        raise ConfigError("internal: the model holds non-parameter state that a checkpoint cannot fill")
    leaves = _flat(params)
    filled = {}
    for target, value in tensors:
        pairs = ([(target + "." + f, v) for f, v in zip(MXFP4Weight._fields, value)] if isinstance(value, tuple)
                 else [(target, value)])
        for name, arr in pairs:
            if name not in leaves:
                raise ConvertError(f"{where}: array {name} is not a parameter of the {module.cfg.architecture} model")
            if name in filled:
                raise ConvertError(f"{where}: parameter {name} appears twice")
            want = leaves[name]
            if tuple(arr.shape) != tuple(want.shape):
                raise ConvertError(f"{where}: shape mismatch for {name}: expected {list(want.shape)}, "
                                   f"found {list(arr.shape)}")
            arr = np.asarray(arr).astype(want.dtype, copy=False)
            filled[name] = jax.device_put(arr, _sharding(name, arr.shape, mesh))
            del arr
    missing = sorted(set(leaves) - set(filled))
    if missing:
        raise ConvertError(f"{where}: checkpoint lacks parameter(s) {listing(missing)}")
    params = jax.tree_util.tree_map_with_path(lambda p, _: filled.pop(path_name(p)), params)
    nnx.update(module, params)


def _sharding(name, shape, mesh) -> Optional[jax.sharding.Sharding]:
    if mesh is None:
        return None
    # the mesh's own expert axes too: with experts over ("context", "model") (`expert=8,tensor=1,context=8`) a
    # "model"-only spec would first put every expert on every device
    return NamedSharding(mesh, mesh_partition_spec(name, shape, mesh))


def _random_bytes(key, shape: tuple) -> jax.Array:
    """uint8 random bits of ``shape`` ``[E, ...]``, one ``[...]`` slice at a time, drawn as uint32 words where the
    last axis allows: a whole uint8 draw takes about 16x its output in scratch (5.6 GB for 0.35 GB of one layer's
    MXFP4 codes), a slice's words a few tens of MB."""
    def one(k):
        if shape[-1] % 4:
            return jax.random.bits(k, shape[1:], jnp.uint8)
        words = jax.random.bits(k, (*shape[1:-1], shape[-1] // 4), jnp.uint32)
        return jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(shape[1:])

    return jax.lax.map(one, jax.random.split(key, shape[0]))


def random_mxfp4_model(cfg: ModelConfig, *, seed: int = 0, dtype=jnp.bfloat16, mesh=None,
                       kernels: Optional[KernelConfig] = None, platform: Optional[str] = None) -> Model:
    """Random weights for a model too large to draw whole, with its routed experts as MXFP4 -- what a real-size
    benchmark on one GPU needs (Kimi-Linear-48B-A3B: ≈ 98 GB in bf16, ≈ 29 GB with MXFP4 experts).

    Every other parameter is drawn by its module's own initialiser, one jitted program per top level / per layer
    signature that returns only those parameters, so XLA drops the dense experts' draws and no device ever holds
    them. The routed experts are random e2m1 codes (all 16, uniform) under one E8M0 scale per matrix chosen so that
    their standard deviation is about 1 / sqrt(input width), as a dense initialiser's. Peak memory: the finished
    parameters plus one layer's non-expert parameters (the experts' codes are drawn one expert at a time). Then the
    experts are laid out for the platform's kernels, as a checkpoint's are."""
    dtype = jnp.dtype(_parse_dtype(dtype) if isinstance(dtype, str) else dtype)
    kernels = kernels or KernelConfig()
    module = abstract_module(cfg, dtype)
    for _, moe in moe_layers(module):
        moe.set_experts(MXFP4Experts.like(moe.expert_weights()))
    _, params, _ = nnx.split(module, nnx.Param, ...)
    leaves = _flat(params)
    root = jax.random.key(seed)

    def drawn(build):
        """A jitted key -> {name: array} of the module `build(rngs)` makes, its routed experts left out."""
        def run(key):
            flat = {path_name(p): v for p, v in
                    jax.tree_util.tree_flatten_with_path(nnx.state(build(nnx.Rngs(key)), nnx.Param))[0]}
            return {n: v for n, v in flat.items() if not is_routed_expert(n)}
        return jax.jit(run)

    filled = {}
    top = drawn(lambda rngs: KimiForCausalLM(cfg.replace(layer_kinds=(), dense_layers=()), rngs=rngs, dtype=dtype))
    filled.update(top(jax.random.fold_in(root, 0)))
    by_signature = {}
    for i in range(cfg.num_layers):
        sig = (cfg.layer_kinds[i], cfg.is_moe_layer(i))
        if sig not in by_signature:
            by_signature[sig] = drawn(lambda rngs, i=i: DecoderLayer(cfg, i, rngs=rngs, dtype=dtype))
        for name, value in by_signature[sig](jax.random.fold_in(root, 1 + i)).items():
            filled[f"layers.{i}.{name}"] = value
    bits = jax.jit(_random_bytes, static_argnums=1)
    for n, (name, want) in enumerate(sorted(leaves.items())):
        if name in filled:
            continue
        if name.endswith(".packed"):  # random e2m1 codes, two a byte
            filled[name] = bits(jax.random.fold_in(root, 10_000 + n), tuple(want.shape))
        elif name.endswith(".scale"):  # E8M0: 2^e ≈ 1 / (2.93 · sqrt(K)), 2.93 = the e2m1 codes' RMS
            k = 2 * leaves[name[: -len("scale")] + "packed"].shape[-1]
            exponent = round(math.log2(1.0 / (2.93 * math.sqrt(k))))
            filled[name] = jnp.full(want.shape, 127 + exponent, jnp.uint8)
    missing = sorted(set(leaves) - set(filled))
    if missing:
        raise ConfigError(f"internal: random weights left {listing(missing)} undrawn")
    for name, want in leaves.items():
        value = filled[name].astype(want.dtype)
        filled[name] = value if mesh is None else jax.device_put(value, _sharding(name, value.shape, _mesh(mesh)))
    nnx.update(module, jax.tree_util.tree_map_with_path(lambda p, _: filled.pop(path_name(p)), params))
    prepare_experts(module, kernels, platform)
    return Model(module, dtype, mesh=_mesh(mesh), kernels=kernels, platform=platform)
