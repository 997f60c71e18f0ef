"""Loading checkpoints into a `Model`: a converted kimi_jax directory, or a Hugging Face directory converted on the
fly in memory (no temporary files).

The model is built abstractly (`nnx.eval_shape`, nothing allocated, nothing randomly initialised); each parameter
leaf is then filled from the checkpoint, checked against the abstract shape, cast to the abstract dtype (the model
keeps some parameters in float32 whatever `dtype` says) and placed on its devices one array at a time.

Quantised weights: FP8 block weights kept by `--dtype keep` and MXFP4-packed routed experts are dequantised here
into the model's plain expert / projection arrays. This is a stopgap until the MoE kernel consumes packed experts;
until then a loaded model holds experts at full `dtype` width.

With `mesh`, each parameter is placed as it is filled, with the partition spec of `sharding.param_partition_spec`
(the sharding package's rules; a mesh without a "model" axis replicates), so no host ever holds a second copy.
"""

from __future__ import annotations

import logging
import os
from typing import Iterator, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .config import ConfigError, ModelConfig, load_config

log = logging.getLogger("kimi_jax")


def load(path, mesh=None, dtype=None, kernels=None):
    """A converted kimi_jax checkpoint dir or a Hugging Face checkpoint dir -> `Model`.

    dtype: parameter dtype of the model (None: the checkpoint's, i.e. that of its embedding table).
    mesh: None, a `jax.sharding.Mesh` with a "model" axis, or a `--mesh` string such as "8x1".
    kernels: a `KernelConfig` (default: "auto").
    """
    from convert import store
    from convert.errors import ConvertError

    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ConfigError(f"{path!r} is not a checkpoint directory")
    if os.path.isfile(os.path.join(path, store.META_NAME)):
        meta = store.read_meta(path)
        cfg = load_config(path)
        default = np.dtype(meta["param_dtype"])
        arrays = lambda shapes, dtypes: _converted_arrays(path, meta, shapes, dtypes)
    elif os.path.isfile(os.path.join(path, "config.json")):
        from convert.plan import make_plan

        plan = make_plan(path)
        cfg = plan.cfg
        embed = next(e for e in plan.entries if e.targets == ("embed_tokens",))
        default = plan.sources.info(embed.src).np_dtype
        arrays = lambda shapes, dtypes: _hf_arrays(plan, dtypes)
    else:
        raise ConvertError(f"{path} holds neither a kimi_jax checkpoint ({store.META_NAME}) nor a Hugging Face "
                           f"checkpoint (config.json)")
    dtype = jnp.dtype(dtype) if dtype is not None else jnp.dtype(default)
    return assemble(cfg, arrays, dtype=dtype, mesh=mesh, kernels=kernels, where=path)


def assemble(cfg: ModelConfig, arrays, *, dtype, mesh=None, kernels=None, where: str = "checkpoint"):
    """Build the model abstractly and fill its parameters from `arrays(shapes, dtypes)`, an iterator of
    (parameter path, numpy array)."""
    from convert.errors import ConvertError

    from .kernels import KernelConfig
    from .model import Model, _mesh
    from .modules.decoder import KimiForCausalLM

    mesh = _mesh(mesh)
    kernels = kernels or KernelConfig()
    abstract = nnx.eval_shape(lambda: KimiForCausalLM(cfg, rngs=nnx.Rngs(0), dtype=dtype, kernels=kernels))
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
        from convert.errors import listing

        raise ConvertError(f"{where}: checkpoint lacks parameter(s) {listing(missing)}")
    params = jax.tree_util.tree_map_with_path(lambda p, _: filled[_path_name(p)], params)
    module = nnx.merge(graphdef, params, rest)
    return Model(module, dtype, mesh=mesh)  # Model re-applies sharding.rules: a no-op for arrays placed here


def _path_name(path) -> str:
    parts = (str(getattr(p, "key", getattr(p, "idx", getattr(p, "name", "")))) for p in path)
    return ".".join(x for x in parts if x and x != "value")


def _sharding(name, shape, mesh) -> Optional[jax.sharding.Sharding]:
    if mesh is None:
        return None
    from jax.sharding import NamedSharding, PartitionSpec

    spec = PartitionSpec()
    axes = dict(mesh.shape)
    if "model" in axes:
        try:
            from sharding import param_partition_spec
        except ImportError:
            param_partition_spec = None
        if param_partition_spec is not None:
            spec = param_partition_spec(name, shape, axes["model"])
    return NamedSharding(mesh, spec)


def _converted_arrays(path, meta, shapes, dtypes) -> Iterator[tuple[str, np.ndarray]]:
    from convert import store
    from convert.entries import from_json, to_params

    entries = [from_json(e) for e in meta["entries"]]
    reader = store.PartReader(path, meta["parts"])
    block = tuple(meta.get("fp8_block", (128, 128)))
    for entry in sorted((e for e in entries if e.kind != "extra"), key=lambda e: e.extra["part"]):
        part = reader.get(entry.extra["part"])
        stored = {}
        for n in entry.extra["arrays"]:
            if n not in part:
                from convert.errors import ConvertError

                raise ConvertError(f"{path}: array {n} is missing from {meta['parts'][entry.extra['part']]}")
            stored[n] = part[n]
        try:
            tshapes = [shapes[t] for t in entry.targets]
        except KeyError as e:
            from convert.errors import ConvertError

            raise ConvertError(f"{path}: array {e.args[0]} is not a parameter of this model") from None
        out = to_params(entry, stored, tshapes, [dtypes[t] for t in entry.targets], block)
        yield from out.items()


def _hf_arrays(plan, dtypes) -> Iterator[tuple[str, np.ndarray]]:
    from convert.entries import build

    for entry in plan.entries:
        if entry.kind == "extra":
            continue
        arrays, _ = build(entry, plan.sources, plan.target_shapes(entry), dtypes=[dtypes[t] for t in entry.targets],
                          keep_quant=False, fp8_block=plan.fp8_block)
        yield from arrays.items()
