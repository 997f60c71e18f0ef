"""Architecture detection and the per-architecture name maps (`kimi.py`: K3, K3.1, Kimi-Linear;
`deepseek.py`: DeepSeek-V3.2)."""

from __future__ import annotations

from kimi_jax.config import ConfigError, ModelConfig, SUPPORTED_HF_TYPES, from_hf_config

import convert.archs.deepseek as deepseek
import convert.archs.kimi as kimi

from ..errors import ConvertError

ARCHITECTURES = ("kimi_k3", "kimi_k31", "kimi_linear", "deepseek_v32")


def detect(hf: dict, requested: str = "auto", where: str = "config.json") -> ModelConfig:
    """Parse config.json into a ModelConfig; `requested` (if not "auto") must agree with what the file says."""
    if requested not in ("auto",) + ARCHITECTURES:
        raise ConvertError(f"unknown architecture {requested!r}; choose one of auto, {', '.join(ARCHITECTURES)}")
    if not isinstance(hf, dict):
        raise ConvertError(f"{where} must hold a JSON object, found {type(hf).__name__}")
    mt = hf.get("model_type")
    if mt not in SUPPORTED_HF_TYPES:
        raise ConvertError(f"unknown architecture: {where} has model_type={mt!r}; supported model types: "
                           f"{', '.join(SUPPORTED_HF_TYPES)} (architectures {', '.join(ARCHITECTURES)})")
    try:
        cfg = from_hf_config(hf)
    except ConfigError as e:
        raise ConvertError(f"{where}: {e}") from None
    except (AttributeError, KeyError, TypeError, ValueError) as e:  # e.g. a sub-config that is not an object
        raise ConvertError(f"{where}: incomplete or malformed {mt} config ({type(e).__name__}: {e})") from None
    if requested != "auto" and requested != cfg.architecture:
        raise ConvertError(f"--architecture {requested} does not match {where}, which describes {cfg.architecture} "
                           f"(model_type {mt!r})")
    return cfg


def name_map(cfg: ModelConfig, names):
    """(entries, is_extra) for the architecture of `cfg`; `names` are the tensors present in the source."""
    if cfg.architecture == "deepseek_v32":
        return deepseek.entries(cfg, names), deepseek.extra_predicate(cfg)
    return kimi.entries(cfg, names), kimi.extra_predicate(cfg)
