"""Model configuration as data: frozen dataclasses for the whole Kimi family (docs/model.md §1–7).

One `ModelConfig` describes Kimi K3.1 Pro, Kimi K3, Kimi-Linear and DeepSeek-V3.2; every architectural
difference is a field here, never a flag checked somewhere in the modules. `from_hf_config` parses a Hugging Face
`config.json`; `PRESETS` holds the full-size models and small ones for CPU.

Layer lists in Hugging Face configs are 1-indexed; everything in this module is 0-indexed.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, Literal, Optional

GateForm = Literal["lower_bound", "plain"]
Activation = Literal["situ", "swiglu", "clamped_swiglu"]
LayerKind = Literal["kda", "mla"]


class ConfigError(ValueError):
    """A configuration that this package does not understand (bad architecture, inconsistent sizes)."""


@dataclass(frozen=True)
class KDAConfig:
    """Kimi Delta Attention (docs/model.md §4)."""

    num_heads: int
    head_dim: int
    conv_kernel: int = 4
    gate_form: GateForm = "lower_bound"  # K3/GLM: lower_bound*sigmoid(...); Kimi-Linear: -exp(A)*softplus(...)
    gate_lower_bound: float = -5.0
    output_gate_rank: Optional[int] = None  # None: full-rank g_proj (K3); int: low-rank g_a/g_b (Kimi-Linear)
    a_log_checkpoint_size: Optional[int] = None  # K3 stores A_log padded to 128; only num_heads entries are real
    chunk_size: int = 64
    conv_activation: str = "silu"
    o_norm_eps: float = 1e-5

    @property
    def proj_dim(self) -> int:
        return self.num_heads * self.head_dim


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding for the DeepSeek MLA variant (interleaved pairs), with optional YaRN scaling."""

    theta: float = 10000.0
    interleaved: bool = True
    yarn_factor: Optional[float] = None
    original_max_positions: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    # YaRN cos/sin scale ("attention factor"). None: the transformers rule, m(f, mscale) / m(f, mscale_all_dim) when
    # BOTH are non-zero, else m(f) (a lone `mscale` is ignored); a number (HF `attention_factor`) overrides it.
    # DeepSeek's own inference code never scales cos/sin; with the released mscale = mscale_all_dim = 1 both give 1.
    attention_factor: Optional[float] = None
    truncate: bool = True  # YaRN correction range rounded to whole dims (HF `truncate`, default True)


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (docs/model.md §5). `rope is None` means NoPE (K3, Kimi-Linear)."""

    num_heads: int
    q_lora_rank: Optional[int]
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    output_gate: bool = False  # K3: attn *= sigmoid(x @ Wg) before o_proj
    rope: Optional[RopeConfig] = None
    q_norm_eps: float = 1e-6
    kv_norm_eps: float = 1e-6

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim ** -0.5
        if self.rope is not None and self.rope.yarn_factor and self.rope.mscale_all_dim:
            m = yarn_mscale(self.rope.yarn_factor, self.rope.mscale_all_dim)
            scale = scale * m * m
        return scale


def yarn_mscale(factor: float, mscale: float) -> float:
    import math

    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class IndexerConfig:
    """DSA lightning indexer (docs/model.md §6)."""

    num_heads: int
    head_dim: int
    topk: int
    rope_dims: int = 0  # DeepSeek-V3.2: RoPE (half-split) on the first 64 dims; K3.1: none
    norm_eps: float = 1e-5
    hadamard_rotate: bool = False  # (unverified for K3.1) rotate q and k before FP8 scoring


@dataclass(frozen=True)
class MoEConfig:
    """Routed experts with shared experts (docs/model.md §7)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    num_shared_experts: int = 1
    num_groups: int = 1
    topk_groups: int = 1
    renormalize: bool = True
    routed_scaling_factor: float = 1.0
    latent_size: Optional[int] = None  # K3 latent MoE: routed experts run at this width
    latent_norm: bool = False
    bias_in_weights: bool = False  # quirk of some published Kimi-Linear copies; transformers 5.23 does not

    @property
    def shared_intermediate_size(self) -> int:
        return self.intermediate_size * self.num_shared_experts


VisionNorm = Literal["rms", "layer"]
PosResize = Literal["bilinear", "bicubic"]
ProjectorNorm = Literal["post", "pre"]


@dataclass(frozen=True)
class VisionConfig:
    """MoonViT3d vision tower + multimodal projector (docs/model.md §9); `kimi_jax/modules/vision.py` runs it.

    Defaults are K3 / K3.1 as docs/model.md §9 reads: width 1024, 27 pre-norm blocks, 12 heads of 128 (so the fused qkv
    is 3·1536 wide, not 3·width), gelu-tanh MLP 4096, RMSNorm, no biases, the learned 64×64 position table resized
    bilinearly, 2-D RoPE, 2×2 merge to 4096, projector Linear 4096→4096, exact GELU, Linear 4096→7168, RMSNorm on the
    output. `kimi_k25()` is the variant transformers 5.23 ships as Kimi-K2.5 (LayerNorm with bias, biased linears,
    width 1152, 16 heads of 72, MLP 4304, bicubic table resize, an additive time sinusoid for video, projector
    LayerNorm before the merge-and-project).

    Not in the published material (docs/model.md §9), chosen here and worth checking against a real K3 config:
    `norm_eps` (1e-5; one third-party K3 port builds its vision RMSNorms with torch's default eps, finfo(dtype).eps) and
    `pos_time` (0 = no time term; the same port adds K2.5's time sinusoid and resizes bicubically).
    """

    patch_size: int = 14
    hidden_size: int = 1024
    num_layers: int = 27
    num_heads: int = 12
    head_dim: int = 128
    intermediate_size: int = 4096
    merge: int = 2  # merge × merge patches become one token
    pos_table: int = 64  # learned position table is pos_table × pos_table × hidden_size
    projector_hidden: int = 4096  # = hidden_size · merge² (the merged width the projector's first Linear keeps)
    text_hidden: int = 7168
    norm: VisionNorm = "rms"  # "layer": LayerNorm with bias
    norm_eps: float = 1e-5
    bias: bool = False  # biases on patch embedding, qkv, wo, MLP and projector linears
    pos_resize: PosResize = "bilinear"  # table resize to each image's patch grid (align_corners=False, no antialias)
    pos_time: int = 0  # >0: frames of the additive time sinusoid (video); a clip may have at most this many frames
    rope_theta: float = 10000.0
    projector_norm: ProjectorNorm = "post"  # "post": RMSNorm(text_hidden) after the MLP; "pre": LayerNorm(hidden)
    projector_eps: float = 1e-5
    projector_gelu_tanh: bool = False  # projector GELU: exact erf (nn.GELU()) unless True
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    max_patches: int = 16384  # the processor's budget of patches per image (it downscales beyond it)
    max_patches_per_side: int = 512
    # the `<|media_pad|>` id (docs/model.md §11: 163605): a prompt carries one per image token, replaced by the features
    image_token_id: int = 163605

    def __post_init__(self):
        if self.norm not in ("rms", "layer"):
            raise ConfigError(f"vision norm must be 'rms' or 'layer', got {self.norm!r}")
        if self.pos_resize not in ("bilinear", "bicubic"):
            raise ConfigError(f"vision pos_resize must be 'bilinear' or 'bicubic', got {self.pos_resize!r}")
        if self.projector_norm not in ("post", "pre"):
            raise ConfigError(f"vision projector_norm must be 'post' or 'pre', got {self.projector_norm!r}")
        if self.head_dim % 4:
            raise ConfigError(f"vision head_dim {self.head_dim} must be a multiple of 4 (2-D RoPE: h and w pairs)")
        if self.projector_hidden != self.merged_width:
            raise ConfigError(f"vision projector_hidden {self.projector_hidden} must equal hidden_size·merge² = "
                              f"{self.merged_width}")
        if self.pos_time and self.hidden_size % 2:
            raise ConfigError("vision hidden_size must be even for the time sinusoid")

    @property
    def qkv_width(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def merged_width(self) -> int:
        return self.hidden_size * self.merge * self.merge

    @classmethod
    def kimi_k25(cls, text_hidden: int = 7168, **changes: Any) -> "VisionConfig":
        """The Kimi-K2.5 tower + projector as transformers 5.23 builds it (`Kimi_K25VisionConfig` defaults)."""
        base = dict(hidden_size=1152, num_layers=27, num_heads=16, head_dim=72, intermediate_size=4304,
                    projector_hidden=1152 * 4, text_hidden=text_hidden, norm="layer", norm_eps=1e-5, bias=True,
                    pos_resize="bicubic", pos_time=4, projector_norm="pre", projector_eps=1e-5)
        base.update(changes)
        if "hidden_size" in changes and "projector_hidden" not in changes:
            base["projector_hidden"] = base["hidden_size"] * base.get("merge", 2) ** 2
        return cls(**base)

    @classmethod
    def from_dict(cls, d: dict) -> "VisionConfig":
        """Our own `to_dict` form; tuples come back from JSON lists, unknown keys are refused."""
        d = dict(d)
        for key in ("image_mean", "image_std"):
            if key in d:
                d[key] = tuple(d[key])
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ConfigError(f"unknown vision config keys: {', '.join(unknown)}")
        return cls(**d)


@dataclass(frozen=True)
class ModelConfig:
    """One whole model. `layer_kinds[i]` is 'kda' or 'mla'; `dense_layers` use the dense FFN, the rest the MoE."""

    architecture: str
    vocab_size: int
    hidden_size: int
    layer_kinds: tuple[LayerKind, ...]
    dense_layers: tuple[int, ...]
    dense_intermediate_size: int
    mla: MLAConfig
    moe: MoEConfig
    kda: Optional[KDAConfig] = None
    indexer: Optional[IndexerConfig] = None
    attn_res_block_size: Optional[int] = None  # None: plain residual stream
    activation: Activation = "swiglu"
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = False
    max_position_embeddings: int = 1 << 20
    vision: Optional[VisionConfig] = None
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None
    pad_token_id: Optional[int] = None

    def __post_init__(self):
        if any(k not in ("kda", "mla") for k in self.layer_kinds):
            raise ConfigError(f"layer kinds must be 'kda' or 'mla', got {sorted(set(self.layer_kinds))}")
        if "kda" in self.layer_kinds and self.kda is None:
            raise ConfigError("config has KDA layers but no kda block")
        sizes = {"vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
                 "attention heads": self.mla.num_heads, "kv_lora_rank": self.mla.kv_lora_rank,
                 "v_head_dim": self.mla.v_head_dim, "num_experts": self.moe.num_experts,
                 "moe_intermediate_size": self.moe.intermediate_size, "expert groups": self.moe.num_groups}
        if self.mla.q_lora_rank is not None:
            sizes["q_lora_rank"] = self.mla.q_lora_rank
        if self.dense_layers:
            sizes["intermediate_size"] = self.dense_intermediate_size
        if self.kda is not None:
            sizes.update({"KDA heads": self.kda.num_heads, "KDA head_dim": self.kda.head_dim})
        bad = [f"{k} = {v}" for k, v in sizes.items() if not v > 0]
        if bad:
            raise ConfigError(f"sizes must be positive: {', '.join(bad)}")
        if not 1 <= self.moe.top_k <= self.moe.num_experts:
            raise ConfigError(f"experts per token ({self.moe.top_k}) must be between 1 and the number of experts "
                              f"({self.moe.num_experts})")
        if self.moe.num_experts % self.moe.num_groups:
            raise ConfigError(f"{self.moe.num_experts} experts do not split into {self.moe.num_groups} groups")
        if self.vision is not None and self.vision.text_hidden != self.hidden_size:
            raise ConfigError(f"the vision projector's output width ({self.vision.text_hidden}) must equal the text "
                              f"model's hidden size ({self.hidden_size})")
        if self.kda is not None and self.kda.a_log_checkpoint_size is not None:
            if self.kda.a_log_checkpoint_size < self.kda.num_heads:
                raise ConfigError("A_log checkpoint size is smaller than the KDA head count")

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    @property
    def mla_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == "mla")

    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == "kda")

    def is_moe_layer(self, layer: int) -> bool:
        return layer not in self.dense_layers

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # --- serialisation -------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        d = dict(d)
        sub = {"mla": MLAConfig, "moe": MoEConfig, "kda": KDAConfig, "indexer": IndexerConfig, "vision": VisionConfig}
        for key, typ in sub.items():
            if d.get(key) is not None:
                inner = dict(d[key])
                if key == "mla" and inner.get("rope") is not None:
                    inner["rope"] = RopeConfig(**inner["rope"])
                d[key] = VisionConfig.from_dict(inner) if key == "vision" else typ(**inner)
        d["layer_kinds"] = tuple(d["layer_kinds"])
        d["dense_layers"] = tuple(d["dense_layers"])
        return cls(**d)


# ---------------------------------------------------------------------------------------------------------------------
# Presets
# ---------------------------------------------------------------------------------------------------------------------

def k3_layer_kinds(num_layers: int = 93) -> tuple[LayerKind, ...]:
    """K3: MLA at 0-indexed 3, 7, …, and the last layer; KDA elsewhere."""
    kinds = ["kda"] * num_layers
    for i in range(3, num_layers, 4):
        kinds[i] = "mla"
    kinds[num_layers - 1] = "mla"
    return tuple(kinds)


def _kimi_k3(with_indexer: bool) -> ModelConfig:
    return ModelConfig(
        architecture="kimi_k31" if with_indexer else "kimi_k3",
        vocab_size=163840,
        hidden_size=7168,
        layer_kinds=k3_layer_kinds(93),
        dense_layers=(0,),
        dense_intermediate_size=33792,
        kda=KDAConfig(num_heads=96, head_dim=128, gate_form="lower_bound", gate_lower_bound=-5.0,
                      output_gate_rank=None, a_log_checkpoint_size=128),
        mla=MLAConfig(num_heads=96, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                      v_head_dim=128, output_gate=True, rope=None, q_norm_eps=1e-5, kv_norm_eps=1e-5),
        indexer=IndexerConfig(num_heads=32, head_dim=128, topk=2048, rope_dims=0, norm_eps=1e-5) if with_indexer else None,
        moe=MoEConfig(num_experts=896, top_k=16, intermediate_size=3072, num_shared_experts=2, num_groups=1,
                      topk_groups=1, renormalize=True, routed_scaling_factor=1.0, latent_size=3584, latent_norm=True),
        attn_res_block_size=12,
        activation="situ",
        rms_norm_eps=1e-5,
        max_position_embeddings=1 << 20,
        vision=VisionConfig(),
        bos_token_id=163584,
        eos_token_id=163586,
        pad_token_id=163839,
    )


def _kimi_linear_48b() -> ModelConfig:
    full = (4, 8, 12, 16, 20, 24, 27)  # 1-indexed, as in the released config.json
    kinds = tuple("mla" if (i + 1) in full else "kda" for i in range(27))
    return ModelConfig(
        architecture="kimi_linear",
        vocab_size=163840,
        hidden_size=2304,
        layer_kinds=kinds,
        dense_layers=(0,),
        dense_intermediate_size=9216,
        kda=KDAConfig(num_heads=32, head_dim=128, gate_form="plain", output_gate_rank=128),
        mla=MLAConfig(num_heads=32, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                      v_head_dim=128, output_gate=False, rope=None),
        moe=MoEConfig(num_experts=256, top_k=8, intermediate_size=1024, num_shared_experts=1,
                      routed_scaling_factor=2.446),
        activation="swiglu",
        rms_norm_eps=1e-5,
        bos_token_id=163584,
        eos_token_id=163586,
        pad_token_id=163839,
    )


def _deepseek_v32() -> ModelConfig:
    return ModelConfig(
        architecture="deepseek_v32",
        vocab_size=129280,
        hidden_size=7168,
        layer_kinds=("mla",) * 61,
        dense_layers=(0, 1, 2),
        dense_intermediate_size=18432,
        mla=MLAConfig(num_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                      v_head_dim=128, output_gate=False,
                      rope=RopeConfig(theta=10000.0, interleaved=True, yarn_factor=40.0, original_max_positions=4096,
                                      beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)),
        indexer=IndexerConfig(num_heads=64, head_dim=128, topk=2048, rope_dims=64, norm_eps=1e-6),
        moe=MoEConfig(num_experts=256, top_k=8, intermediate_size=2048, num_shared_experts=1, num_groups=8,
                      topk_groups=4, routed_scaling_factor=2.5),
        activation="swiglu",
        rms_norm_eps=1e-6,
        max_position_embeddings=163840,
        bos_token_id=0,
        eos_token_id=1,
    )


def _tiny() -> ModelConfig:
    """K3.1 architecture with every feature on and small dims (CPU tests, the default served model)."""
    return ModelConfig(
        architecture="kimi_k31",
        vocab_size=1024,
        hidden_size=64,
        layer_kinds=k3_layer_kinds(8),  # KDA 0,1,2,4,5,6; MLA 3,7
        dense_layers=(0,),
        dense_intermediate_size=128,
        kda=KDAConfig(num_heads=2, head_dim=16, gate_form="lower_bound", gate_lower_bound=-5.0,
                      output_gate_rank=None, a_log_checkpoint_size=4),
        mla=MLAConfig(num_heads=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                      v_head_dim=16, output_gate=True, rope=None, q_norm_eps=1e-5, kv_norm_eps=1e-5),
        # index head dim and latent width are multiples of 32, so every format runs on it: MXFP4 index keys (one
        # E8M0 scale per 32) and MXFP4 routed experts (input widths 64 and 32)
        indexer=IndexerConfig(num_heads=2, head_dim=32, topk=8, rope_dims=0, norm_eps=1e-5),
        moe=MoEConfig(num_experts=8, top_k=2, intermediate_size=32, num_shared_experts=2, latent_size=64,
                      latent_norm=True, routed_scaling_factor=1.0),
        attn_res_block_size=3,  # blocks close at layers 0, 3, 6: three stored blocks + the partial sum
        activation="situ",
        rms_norm_eps=1e-5,
        max_position_embeddings=4096,
        # K3's tower at toy size (head_dim ≠ width / heads, as in K3); no effect on the text model or its counts
        vision=VisionConfig(hidden_size=32, num_layers=2, num_heads=3, head_dim=16, intermediate_size=64, pos_table=8,
                            projector_hidden=128, text_hidden=64, image_token_id=1009),
        bos_token_id=1000,
        eos_token_id=1002,
        pad_token_id=1023,
    )


def _kimi_k31_reduced() -> ModelConfig:
    """Kimi K3.1 at full width and reduced depth, for serving benchmarks on one GPU (random weights).

    Full: hidden 7168, 96 KDA heads and 96 MLA heads of 128, the DSA indexer, the latent MoE (3584 latent, expert
    width 3072, top-16, 2 shared experts), Block Attention Residuals, SiTU.  Reduced: 4 layers in K3.1's 3:1 mix
    (KDA, KDA, KDA, MLA), all MoE (no dense first layer); 128 routed experts instead of 896 (≈ 8.4 GB per layer in
    bf16 instead of 59 GB); attention-residual blocks of 2 layers (so a 4-layer model still closes blocks); and the
    tiny tokenizer's 1024-id vocabulary, so the built-in tokenizer serves it and the vocabulary projections stay
    as small a share of a decode step as in the 93-layer model. 19.2B parameters (35.8 GiB in bf16). K3.1's 1M
    positions (its MLA is NoPE, so positions cost no table), for the long-context benchmarks.
    """
    full = _kimi_k3(True)
    return full.replace(
        vocab_size=1024,
        layer_kinds=("kda", "kda", "kda", "mla"),
        dense_layers=(),
        moe=dataclasses.replace(full.moe, num_experts=128),
        attn_res_block_size=2,
        vision=None,
        bos_token_id=1000,
        eos_token_id=1002,
        pad_token_id=1023,
    )


PRESETS = {
    "kimi-k3.1-pro": lambda: _kimi_k3(True),
    "kimi-k3.1-reduced": _kimi_k31_reduced,
    "kimi-k3": lambda: _kimi_k3(False),
    "kimi-linear-48b": _kimi_linear_48b,
    "deepseek-v3.2": _deepseek_v32,
    "tiny": _tiny,
}


def get_preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]()


# ---------------------------------------------------------------------------------------------------------------------
# Hugging Face config.json parsing
# ---------------------------------------------------------------------------------------------------------------------

SUPPORTED_HF_TYPES = ("kimi_k3", "kimi_linear", "deepseek_v32")


def _layer_kinds_from_lists(n: int, full_1idx, linear_1idx) -> tuple[LayerKind, ...]:
    kinds: list[Optional[str]] = [None] * n
    for i in full_1idx:
        if not 1 <= i <= n:
            raise ConfigError(f"full_attn_layers entry {i} is outside 1..{n} (the list is 1-indexed)")
        kinds[i - 1] = "mla"
    for i in linear_1idx:
        if not 1 <= i <= n:
            raise ConfigError(f"kda_layers entry {i} is outside 1..{n} (the list is 1-indexed)")
        if kinds[i - 1] == "mla":
            raise ConfigError(f"layer {i} (1-indexed) is listed both as KDA and as full attention")
        kinds[i - 1] = "kda"
    missing = [i + 1 for i, k in enumerate(kinds) if k is None]
    if missing:
        raise ConfigError(f"layers {missing} (1-indexed) are in neither kda_layers nor full_attn_layers")
    return tuple(kinds)  # type: ignore[return-value]


def _activation(hf: dict) -> Activation:
    act = hf.get("hidden_act", "silu")
    if act == "situ":
        return "situ"
    if act in ("silu", "swish"):
        return "swiglu"
    raise ConfigError(f"unsupported hidden_act {act!r} (expected 'situ' or 'silu')")


def _dense_layers(hf: dict, n: int) -> tuple[int, ...]:
    mlp_types = hf.get("mlp_layer_types")
    if mlp_types:
        if len(mlp_types) != n:
            raise ConfigError(f"mlp_layer_types lists {len(mlp_types)} layers but num_hidden_layers is {n}")
        return tuple(i for i, t in enumerate(mlp_types) if t == "dense")
    k = int(hf.get("first_k_dense_replace", 1))
    return tuple(range(min(k, n)))


def _kimi_from_hf(hf: dict, top: dict) -> ModelConfig:
    n = int(hf["num_hidden_layers"])
    lin = hf.get("linear_attn_config") or {}
    if hf.get("layer_types"):
        if len(hf["layer_types"]) != n:
            raise ConfigError(f"layer_types lists {len(hf['layer_types'])} layers but num_hidden_layers is {n}")
        kinds = tuple("mla" if t == "full_attention" else "kda" for t in hf["layer_types"])
    elif "full_attn_layers" in lin and "kda_layers" in lin:
        kinds = _layer_kinds_from_lists(n, lin["full_attn_layers"], lin["kda_layers"])
    else:
        raise ConfigError("kimi config has neither layer_types nor linear_attn_config.{kda_layers,full_attn_layers}")
    is_k3 = top.get("model_type") == "kimi_k3" or hf.get("hidden_act") == "situ" or "attn_res_block_size" in hf
    heads = int(lin.get("num_heads", hf.get("linear_num_heads", 32)))
    head_dim = int(lin.get("head_dim", hf.get("linear_head_dim", 128)))
    full_rank_gate = bool(lin.get("use_full_rank_gate", is_k3))
    lower_bound = lin.get("gate_lower_bound")
    kda = KDAConfig(
        num_heads=heads,
        head_dim=head_dim,
        conv_kernel=int(lin.get("short_conv_kernel_size", hf.get("linear_conv_kernel_dim", 4))),
        gate_form="lower_bound" if lower_bound is not None else "plain",
        gate_lower_bound=float(lower_bound) if lower_bound is not None else -5.0,
        output_gate_rank=None if full_rank_gate else head_dim,
        a_log_checkpoint_size=int(lin["a_log_size"]) if "a_log_size" in lin else (128 if is_k3 else None),
        o_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
    )
    eps = float(hf.get("rms_norm_eps", 1e-5))
    mla_eps = eps if is_k3 else 1e-6
    mla = MLAConfig(
        num_heads=int(hf["num_attention_heads"]),
        q_lora_rank=hf.get("q_lora_rank"),
        kv_lora_rank=int(hf.get("kv_lora_rank", 512)),
        qk_nope_head_dim=int(hf.get("qk_nope_head_dim", 128)),
        qk_rope_head_dim=int(hf.get("qk_rope_head_dim", 64)),
        v_head_dim=int(hf.get("v_head_dim", 128)),
        output_gate=bool(hf.get("mla_use_output_gate", False)),
        rope=None,
        q_norm_eps=mla_eps,
        kv_norm_eps=mla_eps,
    )
    indexer = None
    dsa = hf.get("dsa_config") or top.get("dsa_config")
    if dsa:
        indexer = IndexerConfig(
            num_heads=int(dsa.get("index_n_heads", dsa.get("num_heads", 32))),
            head_dim=int(dsa.get("index_head_dim", dsa.get("head_dim", 128))),
            topk=int(dsa.get("index_topk", dsa.get("topk", 2048))),
            rope_dims=0,
            norm_eps=float(dsa.get("norm_eps", eps)),
            hadamard_rotate=bool(dsa.get("hadamard_rotate", False)),
        )
    n_experts = int(hf.get("num_experts", hf.get("num_local_experts", hf.get("n_routed_experts", 256))))
    moe = MoEConfig(
        num_experts=n_experts,
        top_k=int(hf.get("num_experts_per_token", hf.get("num_experts_per_tok", 8))),
        intermediate_size=int(hf["moe_intermediate_size"]),
        num_shared_experts=int(hf.get("num_shared_experts", hf.get("n_shared_experts", 1))),
        num_groups=int(hf.get("num_expert_group", hf.get("n_group", 1)) or 1),
        topk_groups=int(hf.get("topk_group", 1) or 1),
        renormalize=bool(hf.get("moe_renormalize", hf.get("norm_topk_prob", True))),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        latent_size=hf.get("routed_expert_hidden_size"),
        latent_norm=bool(hf.get("latent_moe_use_norm", False)),
    )
    if "mla_use_nope" in hf and not hf["mla_use_nope"]:
        raise ConfigError("kimi MLA with RoPE (mla_use_nope=false) is not a released configuration")
    arch = "kimi_linear"
    if top.get("model_type") == "kimi_k3" or is_k3:
        arch = "kimi_k31" if indexer is not None else "kimi_k3"
    return ModelConfig(
        architecture=arch,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        layer_kinds=kinds,
        dense_layers=_dense_layers(hf, n),
        dense_intermediate_size=int(hf["intermediate_size"]),
        kda=kda,
        mla=mla,
        indexer=indexer,
        moe=moe,
        attn_res_block_size=hf.get("attn_res_block_size"),
        activation=_activation(hf),
        situ_beta=float(hf.get("activation_situ_beta", 4.0)),
        situ_linear_beta=float(hf.get("activation_situ_linear_beta", 25.0)),
        rms_norm_eps=eps,
        # never tied, whatever tie_word_embeddings says: transformers' KimiLinearForCausalLM declares no tied weights
        # (it saves and uses its own lm_head.weight), and K3's lm_head is untied (docs/model.md §2)
        tie_embeddings=False,
        max_position_embeddings=int(hf.get("max_position_embeddings", hf.get("model_max_length", 1 << 20))),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=_first(hf.get("eos_token_id")),
        pad_token_id=hf.get("pad_token_id"),
    )


def _first(x):
    return x[0] if isinstance(x, list) else x


def _deepseek_from_hf(hf: dict) -> ModelConfig:
    n = int(hf["num_hidden_layers"])
    rp = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = float(rp.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise ConfigError(f"unsupported rope_type {rope_type!r} for deepseek_v32 (expected 'default' or 'yarn')")
    yarn = rope_type == "yarn"
    orig = int(rp.get("original_max_position_embeddings", 4096))
    factor = rp.get("factor")
    if yarn and factor is None:  # transformers: max_position_embeddings / original_max_position_embeddings
        factor = float(hf.get("max_position_embeddings", orig)) / orig
    rope = RopeConfig(
        theta=theta,
        # always interleaved: transformers' DeepseekV32Config drops a rope_interleave key, so it changes nothing there
        interleaved=True,
        yarn_factor=float(factor) if yarn else None,
        original_max_positions=orig,
        beta_fast=float(rp.get("beta_fast") or 32.0),
        beta_slow=float(rp.get("beta_slow") or 1.0),
        # absent keys stay 0 ("unset"): the attention-factor rule distinguishes unset from 1
        mscale=float(rp.get("mscale") or 0.0),
        mscale_all_dim=float(rp.get("mscale_all_dim") or 0.0),
        attention_factor=float(rp["attention_factor"]) if rp.get("attention_factor") is not None else None,
        truncate=bool(rp.get("truncate", True)),
    )
    eps = float(hf.get("rms_norm_eps", 1e-6))
    return ModelConfig(
        architecture="deepseek_v32",
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        layer_kinds=("mla",) * n,
        dense_layers=_dense_layers(hf, n),
        dense_intermediate_size=int(hf["intermediate_size"]),
        mla=MLAConfig(
            num_heads=int(hf["num_attention_heads"]),
            q_lora_rank=hf.get("q_lora_rank"),
            kv_lora_rank=int(hf["kv_lora_rank"]),
            qk_nope_head_dim=int(hf["qk_nope_head_dim"]),
            qk_rope_head_dim=int(hf["qk_rope_head_dim"]),
            v_head_dim=int(hf["v_head_dim"]),
            rope=rope,
            # q_a_layernorm / kv_a_layernorm: 1e-6 whatever rms_norm_eps says (transformers and DeepSeek's own code
            # both construct them with the RMSNorm default); the release has rms_norm_eps 1e-6 anyway
            q_norm_eps=1e-6,
            kv_norm_eps=1e-6,
        ),
        indexer=IndexerConfig(
            num_heads=int(hf.get("index_n_heads", 64)),
            head_dim=int(hf.get("index_head_dim", 128)),
            topk=int(hf.get("index_topk", 2048)),
            rope_dims=int(hf.get("qk_rope_head_dim", 64)),
            norm_eps=1e-6,
        ),
        moe=MoEConfig(
            num_experts=int(hf.get("n_routed_experts", 256)),
            top_k=int(hf.get("num_experts_per_tok", 8)),
            intermediate_size=int(hf["moe_intermediate_size"]),
            num_shared_experts=int(hf.get("n_shared_experts", 1)),
            num_groups=int(hf.get("n_group", 1) or 1),
            topk_groups=int(hf.get("topk_group", 1) or 1),
            renormalize=bool(hf.get("norm_topk_prob", True)),
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        ),
        activation=_activation(hf),
        rms_norm_eps=eps,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 163840)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=_first(hf.get("eos_token_id")),
        pad_token_id=hf.get("pad_token_id"),
    )


def from_hf_config(hf_top: dict) -> ModelConfig:
    """Parse a Hugging Face `config.json` dict (kimi_k3 with `text_config`, kimi_linear, deepseek_v32). A missing
    required key is a ConfigError naming it."""
    if not isinstance(hf_top, dict):
        raise ConfigError(f"config.json must hold a JSON object, got {type(hf_top).__name__}")
    _check_router(hf_top.get("text_config") if isinstance(hf_top.get("text_config"), dict) else hf_top)
    try:
        return _from_hf_config(hf_top)
    except KeyError as e:
        raise ConfigError(f"{hf_top.get('model_type')} config.json lacks the required key {e.args[0]!r}") from None


# the routers this package implements (docs/model.md §7: sigmoid scores, a selection-only bias, group-limited top-k); a
# config that names another is refused rather than run with the wrong router
_ROUTER_KEYS = {"moe_router_activation_func": ("sigmoid",), "scoring_func": ("sigmoid",),
                "topk_method": ("noaux_tc", "greedy", "group_limited_greedy")}


def _check_router(hf: dict) -> None:
    for key, ok in _ROUTER_KEYS.items():
        if hf.get(key) is not None and hf[key] not in ok:
            raise ConfigError(f"unsupported router: {key}={hf[key]!r} (supported: {', '.join(ok)})")


def _from_hf_config(hf_top: dict) -> ModelConfig:
    model_type = hf_top.get("model_type")
    if model_type == "kimi_k3":
        text = hf_top.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError("kimi_k3 config.json has no text_config block")
        cfg = _kimi_from_hf(text, hf_top)
        if hf_top.get("vision_config") is not None:
            cfg = cfg.replace(vision=vision_from_hf(hf_top["vision_config"], hf_top, cfg.hidden_size))
        return cfg
    if model_type == "kimi_linear":
        return _kimi_from_hf(hf_top, hf_top)
    if model_type == "deepseek_v32":
        if hf_top.get("attention_bias"):  # transformers then adds biases to the attention projections
            raise ConfigError("deepseek_v32 with attention_bias=true (biased attention projections) is not supported")
        return _deepseek_from_hf(hf_top)
    raise ConfigError(
        f"unknown architecture: model_type={model_type!r}; supported: {', '.join(SUPPORTED_HF_TYPES)}")


# HF vision_config keys -> VisionConfig fields; both spellings seen in Moonshot configs (`vt_*` in the remote-code
# MoonViT configs, plain names in transformers'); a key absent keeps docs/model.md §9's value
_VISION_KEYS = {
    "hidden_size": ("vt_hidden_size", "hidden_size"),
    "num_layers": ("vt_num_hidden_layers", "num_hidden_layers"),
    "num_heads": ("vt_num_attention_heads", "num_attention_heads"),
    "head_dim": ("vt_head_dim", "head_dim"),
    "intermediate_size": ("vt_intermediate_size", "intermediate_size"),
    "patch_size": ("patch_size",),
    "pos_table": ("init_pos_emb_height", "pos_emb_height"),
    "rope_theta": ("rope_theta",),
    "projector_eps": ("projector_ln_eps", "projection_layer_norm_eps"),
}


def vision_from_hf(vc: dict, top: dict, text_hidden: int) -> VisionConfig:
    """The `vision_config` block of a K3 config.json -> VisionConfig. Sizes it does not give keep docs/model.md §9's
    values (head_dim too: 128, so K3's 12 heads make a 1536-wide qkv on a 1024-wide tower, not width / heads)."""
    if not isinstance(vc, dict):
        raise ConfigError("vision_config must be an object")
    fields = {}
    for field, keys in _VISION_KEYS.items():
        for k in keys:
            if vc.get(k) is not None:
                fields[field] = vc[k]
                break
    merge = vc.get("merge_kernel_size")
    if merge is not None:
        merge = tuple(merge) if isinstance(merge, (list, tuple)) else (merge, merge)
        if len(merge) != 2 or merge[0] != merge[1]:
            raise ConfigError(f"vision merge_kernel_size {vc['merge_kernel_size']!r}: only square merges are supported")
        fields["merge"] = int(merge[0])
    base = VisionConfig()
    width, merge_n = fields.get("hidden_size", base.hidden_size), fields.get("merge", base.merge)
    fields["projector_hidden"] = width * merge_n * merge_n
    pad = top.get("image_token_id", top.get("media_placeholder_token_id", base.image_token_id))
    try:
        return dataclasses.replace(base, text_hidden=text_hidden, image_token_id=int(pad), **fields)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"vision_config: {e}") from None


def _parse_file(path: str, parse) -> ModelConfig:
    """A config file through `parse`; unreadable JSON or a bad config is a ConfigError naming the file."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: cannot read it as JSON ({e})") from None
    try:
        return parse(data)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{path}: not a valid config ({type(e).__name__}: {e})") from None


def load_config(path_or_preset: str) -> ModelConfig:
    """A preset name, a kimi_jax checkpoint dir (`kimi_jax_config.json`) or a Hugging Face dir (`config.json`)."""
    if path_or_preset in PRESETS:
        return get_preset(path_or_preset)
    if os.path.isdir(path_or_preset):
        ours = os.path.join(path_or_preset, "kimi_jax_config.json")
        if os.path.exists(ours):
            return _parse_file(ours, ModelConfig.from_dict)
        hf = os.path.join(path_or_preset, "config.json")
        if os.path.exists(hf):
            return _parse_file(hf, from_hf_config)
        raise ConfigError(f"{path_or_preset} holds neither kimi_jax_config.json nor config.json")
    raise ConfigError(f"{path_or_preset!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a directory")
