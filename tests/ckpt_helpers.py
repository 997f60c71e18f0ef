"""Helpers for the conversion tests: rewriting tiny Hugging Face checkpoint directories (dropping, adding,
reshaping or FP8-quantising tensors), comparing directories tensor by tensor, and finding leftovers."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from pallas_kernels.codec import fp8_block_quantize_np
from convert.safetensors_io import SourceSet, read_array, write_file


def read_all(directory) -> dict:
    src = SourceSet(str(directory))
    return {n: np.array(read_array(src.info(n))) for n in sorted(src.names())}


def rewrite_dir(src, dst, transform=None, config=None):
    """Copy a checkpoint dir (side files too) into one `model.safetensors` holding `transform(tensors)`."""
    src, dst = str(src), str(dst)
    tensors = read_all(src)
    if transform is not None:
        tensors = transform(dict(tensors))
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if not name.endswith(".safetensors") and name != "model.safetensors.index.json":
            shutil.copy2(os.path.join(src, name), os.path.join(dst, name))
    write_file(os.path.join(dst, "model.safetensors"), tensors, {"format": "pt"})
    if config is not None:
        with open(os.path.join(dst, "config.json")) as f:
            hf = json.load(f)
        hf = config(hf) or hf
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(hf, f, indent=1)
    return Path(dst)


def fp8_quantizable(name: str, a: np.ndarray) -> bool:
    """Which DeepSeek tensors are FP8 in the release: the 2-D projection / expert weights (not embeddings,
    lm_head, norms, the router or the indexer's weights_proj)."""
    skip = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight", "weights_proj")
    return name.endswith(".weight") and a.ndim == 2 and not any(s in name for s in skip)


def fp8_quantize_dir(src, dst, block=(16, 16)):
    def tf(t):
        out = {}
        for n, a in t.items():
            if fp8_quantizable(n, a):
                q, s = fp8_block_quantize_np(a, block)
                out[n], out[n + "_scale_inv"] = q, s
            else:
                out[n] = a
        return out

    def cfg(hf):
        hf["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}

    return rewrite_dir(src, dst, tf, cfg)


def assert_same_tensors(dir_a, dir_b) -> int:
    """Same names, dtypes, shapes and bytes in both directories. Returns the tensor count."""
    a, b = SourceSet(str(dir_a)), SourceSet(str(dir_b))
    assert set(a.names()) == set(b.names()), sorted(set(a.names()) ^ set(b.names()))[:10]
    for n in a.names():
        x, y = a.info(n), b.info(n)
        assert (x.dtype, x.shape) == (y.dtype, y.shape), (n, x.dtype, x.shape, y.dtype, y.shape)
        assert read_array(x).tobytes() == read_array(y).tobytes(), f"{n} differs"
    return len(a.tensors)


def leftovers(parent) -> list[str]:
    """Temporary directories the converter might have left in `parent`."""
    return sorted(n for n in os.listdir(str(parent)) if ".tmp-" in n)
