"""Checkpoint conversion: Hugging Face safetensors <-> kimi_jax checkpoints (Orbax).

    python -m convert SRC DST [--dtype bf16|fp8|keep] [--architecture auto|kimi_k3|kimi_k31|kimi_linear|deepseek_v32]
    python -m convert --export DST OUT

Python: `convert(src, dst, targets_for, ...)` (the target shapes come from the layer above, the model; the command
passes `kimi_jax.checkpoint.model_targets`), `export(dst, out, ...)`; errors are `ConvertError` with a message naming
the file / tensor at fault. See `tensor_plan.py` for the checks, `store.py` for the checkpoint layout and `entries.py`
for the layout changes.
"""

from .errors import ConvertError

__all__ = ["ConvertError", "convert", "export", "DTYPE_POLICIES"]


def __getattr__(name: str):
    # imported on first use: `python -m convert` installs its Ctrl-C handling before JAX and Orbax load
    if name == "export":
        from .exporter import export

        return export
    if name in ("convert", "DTYPE_POLICIES"):
        from . import importer

        return getattr(importer, name)
    raise AttributeError(f"module 'convert' has no attribute {name!r}")
