"""kimi_jax: a JAX/XLA implementation of Kimi K3.1 Pro and its family."""

from .config import ConfigError, ModelConfig, PRESETS, get_preset, load_config

__all__ = ["ConfigError", "ModelConfig", "PRESETS", "get_preset", "load_config", "Model", "load_model",
           "param_count"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # The model (JAX, Flax) and the loader (Orbax) load on first use: every `python -m kimi_jax.<cli> --help` imports
    # this package first and stays fast.
    if name in ("Model", "param_count"):
        from . import model

        return getattr(model, name)
    if name == "load_model":
        from .checkpoint import load_model

        return load_model
    raise AttributeError(f"module 'kimi_jax' has no attribute {name!r}")
