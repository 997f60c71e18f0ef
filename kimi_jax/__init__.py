"""kimi_jax: a JAX/XLA implementation of Kimi K3.1 Pro and its family."""

from .config import ConfigError, ModelConfig, PRESETS, get_preset, load_config
from .model import Model, load_model, param_count

__all__ = ["ConfigError", "ModelConfig", "PRESETS", "get_preset", "load_config", "Model", "load_model",
           "param_count"]
__version__ = "0.1.0"
