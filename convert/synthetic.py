"""Synthetic Kimi K3 / K3.1 Hugging Face checkpoints (no public K3 weights exist to test against).

`k3_hf_config(cfg)` writes a `config.json` (model_type kimi_k3 with a `text_config`) that `from_hf_config` parses
back into `cfg`; `k3_tensor_specs(cfg)` lists the tensors of the release layout of docs/model.md §8 (`language_model.`
prefix, A_log zero-padded, MXFP4 experts as `weight_packed` + `weight_scale`, a few vision-tower tensors);
`write_k3_checkpoint` fills them with seeded random values and streams them into size-limited shards with a
`model.safetensors.index.json`, one tensor at a time (used by the tests and by bench/convert.py for multi-GiB
checkpoints).
"""

from __future__ import annotations

import json
import math
import os
from typing import Optional

import numpy as np

from kimi_jax.config import ModelConfig, vision_from_hf
from pallas_kernels.codec import MXFP4_GROUP

from .safetensors_io import DTYPES, INDEX_NAME, StreamingWriter

MXFP4_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "mxfp4-pack-quantized",
    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "float",
                                                                     "strategy": "group", "group_size": 32,
                                                                     "scale_dtype": "uint8"}}},
    "ignore": ["re:.*(?<!experts\\.\\d+\\.w[123])$"],
}


# a whole toy MoonViT3d (K3's layout: 2 heads of 8 on a width of 8, so qkv ≠ width as in K3) so that a loaded
# synthetic checkpoint has a working vision tower
SYNTHETIC_VISION_CONFIG = {"model_type": "moonvit3d", "patch_size": 14, "vt_hidden_size": 8, "vt_num_hidden_layers": 1,
                           "vt_num_attention_heads": 2, "vt_head_dim": 8, "vt_intermediate_size": 16,
                           "init_pos_emb_height": 4, "merge_kernel_size": [2, 2]}


def k3_hf_config(cfg: ModelConfig, *, mxfp4: bool = True, vision: bool = True) -> dict:
    kda, mla, moe = cfg.kda, cfg.mla, cfg.moe
    n = cfg.num_layers
    text = {
        "model_type": "kimi_linear",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": n,
        "num_attention_heads": mla.num_heads,
        "num_key_value_heads": mla.num_heads,
        "q_lora_rank": mla.q_lora_rank,
        "kv_lora_rank": mla.kv_lora_rank,
        "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim,
        "mla_use_nope": True,
        "mla_use_output_gate": mla.output_gate,
        "intermediate_size": cfg.dense_intermediate_size,
        "first_k_dense_replace": len(cfg.dense_layers),
        "moe_intermediate_size": moe.intermediate_size,
        "num_experts": moe.num_experts,
        "num_experts_per_token": moe.top_k,
        "num_shared_experts": moe.num_shared_experts,
        "num_expert_group": moe.num_groups,
        "topk_group": moe.topk_groups,
        "moe_renormalize": moe.renormalize,
        "routed_scaling_factor": moe.routed_scaling_factor,
        "moe_router_activation_func": "sigmoid",
        "routed_expert_hidden_size": moe.latent_size,
        "latent_moe_use_norm": moe.latent_norm,
        "hidden_act": "situ",
        "activation_situ_beta": cfg.situ_beta,
        "activation_situ_linear_beta": cfg.situ_linear_beta,
        "rms_norm_eps": cfg.rms_norm_eps,
        "attn_res_block_size": cfg.attn_res_block_size,
        "tie_word_embeddings": cfg.tie_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "torch_dtype": "bfloat16",
        "linear_attn_config": {
            "num_heads": kda.num_heads,
            "head_dim": kda.head_dim,
            "short_conv_kernel_size": kda.conv_kernel,
            "gate_lower_bound": kda.gate_lower_bound,
            "use_full_rank_gate": kda.output_gate_rank is None,
            "a_log_size": kda.a_log_checkpoint_size,
            "kda_layers": [i + 1 for i in cfg.kda_layers],
            "full_attn_layers": [i + 1 for i in cfg.mla_layers],
        },
    }
    if cfg.indexer is not None:
        ix = cfg.indexer
        text["dsa_config"] = {"index_n_heads": ix.num_heads, "index_head_dim": ix.head_dim, "index_topk": ix.topk,
                              "index_layers": [i + 1 for i in cfg.mla_layers]}
    top = {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"], "text_config": text,
           "torch_dtype": "bfloat16"}
    if vision:
        top["vision_config"] = dict(SYNTHETIC_VISION_CONFIG)
    if mxfp4:
        top["quantization_config"] = MXFP4_CONFIG
    return top


def k3_tensor_specs(cfg: ModelConfig, *, mxfp4: bool = True, dtype: str = "BF16", vision: bool = True,
                    ) -> list[tuple[str, str, tuple]]:
    """(HF name, safetensors dtype, shape) of a K3 release-layout checkpoint, in a natural order."""
    D, V = cfg.hidden_size, cfg.vocab_size
    F32, W = "F32", dtype
    pre = "language_model.model."
    out = [(pre + "embed_tokens.weight", W, (V, D))]
    kda, mla, moe = cfg.kda, cfg.mla, cfg.moe
    for L, kind in enumerate(cfg.layer_kinds):
        p = f"{pre}layers.{L}."
        out += [(p + "input_layernorm.weight", W, (D,)), (p + "post_attention_layernorm.weight", W, (D,))]
        if cfg.attn_res_block_size:
            for mix in ("self_attention_res", "mlp_res"):
                out += [(p + f"{mix}_norm.weight", W, (D,)), (p + f"{mix}_proj.weight", W, (1, D))]
        a = p + "self_attn."
        if kind == "kda":
            H, d, K = kda.num_heads, kda.head_dim, kda.conv_kernel
            P = H * d
            out += [(a + f"{c}_proj.weight", W, (P, D)) for c in "qkv"]
            out += [(a + f"{c}_conv1d.weight", F32, (P, 1, K)) for c in "qkv"]
            out += [(a + "f_a_proj.weight", W, (d, D)), (a + "f_b_proj.weight", W, (P, d)),
                    (a + "b_proj.weight", W, (H, D)), (a + "A_log", F32, (kda.a_log_checkpoint_size or H,)),
                    (a + "dt_bias", F32, (P,)), (a + "o_norm.weight", F32, (d,))]
            if kda.output_gate_rank is None:
                out.append((a + "g_proj.weight", W, (P, D)))
            else:
                r = kda.output_gate_rank
                out += [(a + "g_a_proj.weight", W, (r, D)), (a + "g_b_proj.weight", W, (P, r))]
            out.append((a + "o_proj.weight", W, (D, P)))
        else:
            H, R = mla.num_heads, mla.kv_lora_rank
            out += [(a + "q_a_proj.weight", W, (mla.q_lora_rank, D)), (a + "q_a_layernorm.weight", W, (mla.q_lora_rank,)),
                    (a + "q_b_proj.weight", W, (H * mla.qk_head_dim, mla.q_lora_rank)),
                    (a + "kv_a_proj_with_mqa.weight", W, (R + mla.qk_rope_head_dim, D)),
                    (a + "kv_a_layernorm.weight", W, (R,)),
                    (a + "kv_b_proj.weight", W, (H * (mla.qk_nope_head_dim + mla.v_head_dim), R))]
            if mla.output_gate:
                out.append((a + "g_proj.weight", W, (H * mla.v_head_dim, D)))
            out.append((a + "o_proj.weight", W, (D, H * mla.v_head_dim)))
            if cfg.indexer is not None:
                ix = cfg.indexer
                out += [(a + "indexer.wq_b.weight", W, (ix.num_heads * ix.head_dim, mla.q_lora_rank)),
                        (a + "indexer.wk.weight", W, (ix.head_dim, D)),
                        (a + "indexer.k_norm.weight", W, (ix.head_dim,)), (a + "indexer.k_norm.bias", W, (ix.head_dim,)),
                        (a + "indexer.weights_proj.weight", W, (ix.num_heads, D))]
        if cfg.is_moe_layer(L):
            b = p + "block_sparse_moe."
            Lw, Fe, S = moe.latent_size or D, moe.intermediate_size, moe.shared_intermediate_size
            out += [(b + "gate.weight", W, (moe.num_experts, D)), (b + "gate.e_score_correction_bias", F32, (moe.num_experts,))]
            if moe.latent_size:
                out += [(b + "routed_expert_down_proj.weight", W, (Lw, D)), (b + "routed_expert_up_proj.weight", W, (D, Lw))]
                if moe.latent_norm:
                    out.append((b + "routed_expert_norm.weight", W, (Lw,)))
            if moe.num_shared_experts:
                out += [(b + "shared_experts.gate_proj.weight", W, (S, D)), (b + "shared_experts.up_proj.weight", W, (S, D)),
                        (b + "shared_experts.down_proj.weight", W, (D, S))]
            for e in range(moe.num_experts):
                for w, (o, i) in (("w1", (Fe, Lw)), ("w3", (Fe, Lw)), ("w2", (Lw, Fe))):
                    n = b + f"experts.{e}.{w}."
                    if mxfp4:
                        out += [(n + "weight_packed", "U8", (o, i // 2)), (n + "weight_scale", "U8", (o, i // MXFP4_GROUP))]
                    else:
                        out.append((n + "weight", W, (o, i)))
        else:
            I = cfg.dense_intermediate_size
            out += [(p + "mlp.gate_proj.weight", W, (I, D)), (p + "mlp.up_proj.weight", W, (I, D)),
                    (p + "mlp.down_proj.weight", W, (D, I))]
    out += [(pre + "norm.weight", W, (D,))]
    if cfg.attn_res_block_size:
        out += [(pre + "output_attn_res_norm.weight", W, (D,)), (pre + "output_attn_res_proj.weight", W, (1, D))]
    out.append(("language_model.lm_head.weight", W, (V, D)))
    if vision:
        out += [(name, "BF16", shape) for name, shape in _vision_tensor_specs(cfg.hidden_size)]
    return out


def _vision_tensor_specs(text_hidden: int) -> list[tuple[str, tuple]]:
    """(name, shape) of the toy tower of `SYNTHETIC_VISION_CONFIG` in the release naming (K3's MoonViT: RMS norms,
    no biases, the projector's norm after it), transcribed from the release layout on its own, not from the
    model's `checkpoint_layout`, which the loader then checks these against."""
    v = vision_from_hf(SYNTHETIC_VISION_CONFIG, {}, text_hidden)
    if (v.norm, v.bias, v.projector_norm) != ("rms", False, "post"):
        raise ValueError("SYNTHETIC_VISION_CONFIG changed its norms / biases: update _vision_tensor_specs")
    D, Q, I, p, S, W = v.hidden_size, v.qkv_width, v.intermediate_size, v.patch_size, v.pos_table, v.merged_width
    out = [("vision_tower.patch_embed.proj.weight", (D, 3, p, p)),
           ("vision_tower.patch_embed.pos_emb.weight", (S, S, D))]
    for i in range(v.num_layers):
        b = f"vision_tower.encoder.blocks.{i}."
        out += [(b + "norm0.weight", (D,)), (b + "wqkv.weight", (3 * Q, D)), (b + "wo.weight", (D, Q)),
                (b + "norm1.weight", (D,)), (b + "mlp.fc0.weight", (I, D)), (b + "mlp.fc1.weight", (D, I))]
    return out + [("vision_tower.encoder.final_layernorm.weight", (D,)), ("mm_projector.proj.0.weight", (W, W)),
                  ("mm_projector.proj.2.weight", (text_hidden, W)), ("mm_projector.post_norm.weight", (text_hidden,))]


class _Values:
    """Seeded values for synthetic tensors: normals scaled by 1/sqrt(fan_in), norms near 1, A_log = log U(1,16)
    zero-padded, dt_bias ~ N(-2, 1), MXFP4 codes uniform with E8M0 scales 2^-6..2^-2. Large tensors tile a pool of
    random values (fast; content is irrelevant at that size)."""

    POOL = 1 << 22

    def __init__(self, seed: int, heads: int):
        self.rng = np.random.default_rng(seed)
        self.heads = heads
        self.pool = self.rng.standard_normal(self.POOL).astype(np.float32)

    def normal(self, shape, std, dt="F32") -> np.ndarray:
        n = math.prod(shape)
        if n <= self.POOL:
            x = self.rng.standard_normal(n).astype(np.float32) * np.float32(std)
            return x.astype(DTYPES[dt]).reshape(shape)
        # tile a shifted pool already in the target dtype: no float32 temporary of the whole tensor
        pool = (np.roll(self.pool, int(self.rng.integers(self.POOL))) * np.float32(std)).astype(DTYPES[dt])
        return np.resize(pool, n).reshape(shape)

    def __call__(self, name: str, dt: str, shape) -> np.ndarray:
        leaf = name.rsplit(".", 1)[-1]
        if math.prod(shape) > self.POOL and len(shape) == 2 and DTYPES[dt].kind == "f":  # big matrices
            return self.normal(shape, 1.0 if "embed_tokens" in name else shape[-1] ** -0.5, dt)
        if leaf == "weight_packed":
            return self._bytes(shape, 0, 256)
        if leaf == "weight_scale":
            return self._bytes(shape, 121, 126)
        if name.endswith("A_log"):
            a = np.zeros(shape, np.float32)
            a[: self.heads] = np.log(self.rng.uniform(1.0, 16.0, self.heads))
            x = a
        elif name.endswith("dt_bias"):
            x = self.rng.normal(-2.0, 1.0, shape).astype(np.float32)
        elif name.endswith("e_score_correction_bias") or name.endswith(".bias"):
            x = self.rng.normal(0.0, 0.1, shape).astype(np.float32)
        elif "conv1d" in name:
            x = self.normal(shape, 0.5)
        elif "embed_tokens" in name:
            x = self.normal(shape, 1.0)
        elif len(shape) == 1 or "norm" in name:
            x = self.rng.uniform(0.5, 1.5, shape).astype(np.float32)
        else:
            x = self.normal(shape, shape[-1] ** -0.5 if len(shape) == 2 else 0.1)
        return x.astype(DTYPES[dt])

    def _bytes(self, shape, lo, hi) -> np.ndarray:
        n = math.prod(shape)
        if n <= self.POOL:
            return self.rng.integers(lo, hi, n, dtype=np.uint8).reshape(shape)
        pool = self.rng.integers(lo, hi, self.POOL, dtype=np.uint8)
        return np.resize(np.roll(pool, int(self.rng.integers(self.POOL))), n).reshape(shape)


def write_checkpoint(directory: str, config: dict, specs, values, *, shard_bytes: int = 5 << 30,
                     progress: bool = False) -> dict:
    """Write `specs` (name, dtype, shape) filled by `values(name, dtype, shape)` as sharded safetensors + index +
    config.json, streaming one tensor at a time."""
    os.makedirs(directory, exist_ok=True)
    shards, size = [[]], 0
    for name, dt, shape in specs:
        nbytes = math.prod(shape) * DTYPES[dt].itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, dt, tuple(shape)))
        size += nbytes
    n = len(shards)
    files = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map, total = {}, 0
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=sum(math.prod(s) * DTYPES[d].itemsize for _, d, s in specs), unit="B", unit_scale=True,
                   unit_divisor=1024, desc="synthesise")
    for f, shard in zip(files, shards):
        w = StreamingWriter(os.path.join(directory, f), shard, {"format": "pt"})
        for name, dt, shape in shard:
            arr = values(name, dt, shape)
            w.write(name, arr)
            weight_map[name] = f
            total += arr.nbytes
            if bar is not None:
                bar.update(arr.nbytes)
        w.close()
    if bar is not None:
        bar.close()
    with open(os.path.join(directory, INDEX_NAME), "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=1)
    with open(os.path.join(directory, "config.json"), "w") as fh:
        json.dump(config, fh, indent=1)
    return {"files": n, "tensors": len(weight_map), "bytes": total}


def write_k3_checkpoint(directory: str, cfg: ModelConfig, *, seed: int = 0, mxfp4: bool = True, dtype: str = "BF16",
                        vision: bool = True, shard_bytes: int = 5 << 30, progress: bool = False,
                        values: Optional[callable] = None) -> dict:
    """A complete synthetic K3-layout checkpoint of `cfg` in `directory` (plus a tiny tokenizer_config.json)."""
    specs = k3_tensor_specs(cfg, mxfp4=mxfp4, dtype=dtype, vision=vision)
    values = values or _Values(seed, cfg.kda.num_heads if cfg.kda else 1)
    out = write_checkpoint(directory, k3_hf_config(cfg, mxfp4=mxfp4, vision=vision), specs, values,
                           shard_bytes=shard_bytes, progress=progress)
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as fh:
        json.dump({"tokenizer_class": "TikTokenTokenizer", "model_max_length": cfg.max_position_embeddings}, fh)
    return out
