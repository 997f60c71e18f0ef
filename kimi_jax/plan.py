"""`python -m kimi_jax.plan`: parameter counts, cache bytes per token, and how many tokens / 1M-token sequences fit.

Counting convention (also in --help):
- params_total: every parameter of the text model (embeddings, all layers, lm_head), from abstract shapes of the
  real modules (`nnx.eval_shape`); the vision tower is not included.
- params_active: the parameters one token touches: everything except the routed experts that are not chosen, i.e.
  total − (num_experts − top_k) × (params of one routed expert) × (number of MoE layers). Embedding and lm_head count.
Byte figures come from `kimi_jax.cache.CacheLayout`, the layout the engine allocates.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import numpy as np

from .cache import INDEX_DTYPES, KV_DTYPES, CacheLayout, allocate
from .config import ConfigError, ModelConfig, load_config
from .model import abstract_params, is_routed_expert

FP32_KEYS = ("A_log", "dt_bias", "conv1d", "o_norm", "block_sparse_moe.gate", "e_score_correction_bias")
WEIGHT_DTYPES = ("release", "bf16", "fp8", "mxfp4")
ONE_M = 1 << 20


def count_params(cfg: ModelConfig) -> dict:
    shapes = abstract_params(cfg)
    sizes = {k: int(np.prod(v.shape)) for k, v in shapes.items()}
    total = sum(sizes.values())
    routed = sum(n for k, n in sizes.items() if is_routed_expert(k))
    moe_layers = sum(1 for i in range(cfg.num_layers) if cfg.is_moe_layer(i))
    per_expert = routed // max(1, moe_layers * cfg.moe.num_experts)
    inactive = (cfg.moe.num_experts - cfg.moe.top_k) * per_expert * moe_layers
    return {"sizes": sizes, "params_total": total, "params_active": total - inactive, "routed_params": routed}


# the format each family's weights are published in (`--weights-dtype release`): K3 / K3.1 routed experts MXFP4
# and the rest bf16 (docs/model.md §2); DeepSeek-V3.2 block-scaled FP8; Kimi-Linear bf16
RELEASE_FORMAT = {"kimi_k3": "release", "kimi_k31": "release", "deepseek_v32": "fp8", "kimi_linear": "bf16"}


def weight_bytes(cfg: ModelConfig, sizes: dict, weights_dtype: str) -> int:
    """Bytes of all weights. 'release': the family's published format (`RELEASE_FORMAT`; for K3: routed experts
    MXFP4, 4.25 bits, the rest bf16), with fp32 small tensors in every format."""
    if weights_dtype == "release":
        weights_dtype = RELEASE_FORMAT.get(cfg.architecture, "release")
    def mxfp4(n):
        return n // 2 + n // 32

    total = 0
    for k, n in sizes.items():
        if any(s in k for s in FP32_KEYS):
            total += 4 * n
        elif is_routed_expert(k) and weights_dtype in ("release", "mxfp4"):
            total += mxfp4(n)
        elif weights_dtype == "fp8":
            total += n
        elif weights_dtype == "mxfp4" and k.endswith("kernel") and "lm_head" not in k:
            total += mxfp4(n)
        else:
            total += 2 * n
    return total


def parse_mesh(text: str) -> tuple[int, int]:
    try:
        a, b = (int(x) for x in text.lower().split("x"))
        assert a > 0 and b > 0
    except Exception:  # noqa: BLE001
        raise ValueError(f"--mesh must look like AxB (model-parallel x data-parallel), got {text!r}") from None
    return a, b


def plan(cfg: ModelConfig, *, kv_dtype="fp8", index_dtype="fp8", mesh=(1, 1), dcp=1, hbm_gb=141.0,
         weights_dtype="release", gpu_memory_utilization=0.9) -> dict:
    tp, dp = mesh
    if dcp < 1:
        raise ValueError(f"--dcp must be at least 1 (1: no context parallelism), got {dcp}")
    if tp % dcp:
        raise ValueError(f"--dcp {dcp} must divide the model-parallel size {tp}")
    if not 0 < hbm_gb < 1e9:  # also refuses nan and inf (whose capacity would be no integer)
        raise ValueError(f"--hbm-gb must be a positive, finite number of GB per device, got {hbm_gb}")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization must lie in (0, 1], got {gpu_memory_utilization}")
    counts = count_params(cfg)
    layout = CacheLayout(cfg, kv_dtype=kv_dtype, index_dtype=index_dtype)
    wbytes = weight_bytes(cfg, counts["sizes"], weights_dtype)
    usable = hbm_gb * 1e9 * gpu_memory_utilization - wbytes / tp  # per device
    kv_token_dev = layout.kv_bytes_per_token / dcp  # TP: every device keeps every token's latent; DCP: 1/dcp of them
    # the KDA state counted whole on every device, as the published capacities count it (docs/model.md §10: 3
    # sequences under TP8 + FP8 and ≈ 36 under DCP8 + NVFP4 / MXFP4 on 8 × 288 GB come out only this way; a 1/tp
    # share gives 46). kimi_jax shards the state by heads, so this is conservative by < 0.45 GB per sequence and device.
    state_seq_dev = layout.state_bytes_per_sequence
    fits = usable > 0
    max_tokens = int(usable // kv_token_dev) * dp if fits and kv_token_dev else 0
    seq_dev = ONE_M * kv_token_dev + state_seq_dev
    max_1m = int(usable // seq_dev) * dp if fits else 0
    return {
        "architecture": cfg.architecture,
        "params_total": counts["params_total"],
        "params_active": counts["params_active"],
        "kv_bytes_per_token": layout.kv_bytes_per_token,
        # the two parts of kv_bytes_per_token over all MLA layers (K3.1 Pro, FP8: 13,824 latent + 3,168 index key)
        "latent_bytes_per_token": len(cfg.mla_layers) * layout.latent_bytes_per_token_layer,
        "index_bytes_per_token": len(cfg.mla_layers) * layout.index_bytes_per_token_layer,
        "latent_bytes_per_token_layer": layout.latent_bytes_per_token_layer,
        "index_bytes_per_token_layer": layout.index_bytes_per_token_layer,
        "mla_layers": len(cfg.mla_layers),
        "state_bytes_per_sequence": layout.state_bytes_per_sequence,
        "weight_bytes": wbytes,
        "weight_bytes_per_device": wbytes // tp,
        "mesh": f"{tp}x{dp}",
        "dcp": dcp,
        "hbm_gb_per_device": hbm_gb,
        "cache_bytes_per_device": max(0, int(usable)),
        "max_cached_tokens": max_tokens,
        "max_1m_sequences": max_1m,
        "fits": fits,
        "kv_dtype": kv_dtype,
        "index_dtype": index_dtype if cfg.indexer is not None else None,  # no DSA indexer: no index key cached
        "weights_dtype": weights_dtype,
    }


def _human(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m kimi_jax.plan",
        description="Parameter counts, cache bytes per token and capacity for a Kimi-family model.",
        epilog="Counting: params_total = every text-model parameter (embeddings and lm_head included, vision tower "
               "excluded), from abstract shapes of the real modules. params_active = total minus the routed "
               "experts a token does not use: (num_experts - top_k) x one expert x MoE layers. Capacity: each "
               "device gets hbm x utilisation minus its share of the weights (split over the model-parallel axis); "
               "under TP every device keeps every token's latent, under --dcp N tokens are split N ways; each "
               "sequence's KDA state is counted whole on every device, as the published capacities count it.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="preset name (e.g. kimi-k3.1-pro, tiny) or checkpoint directory")
    p.add_argument("--kv-dtype", default="fp8", choices=KV_DTYPES, help="latent cache format (default fp8)")
    p.add_argument("--index-dtype", default="fp8", choices=INDEX_DTYPES, help="index-key cache format (default fp8)")
    p.add_argument("--mesh", default="1x1", help="AxB: A-way model parallel x B-way data parallel (default 1x1)")
    p.add_argument("--dcp", type=int, default=1, help="decode context parallelism: split cached tokens N ways")
    p.add_argument("--hbm-gb", type=float, default=141.0, help="memory per device in GB (default 141, an H200)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="fraction of HBM usable (default 0.9)")
    p.add_argument("--weights-dtype", default="release", choices=WEIGHT_DTYPES,
                   help="release (default) = the family's published format: K3 / K3.1 routed experts MXFP4 and "
                        "the rest bf16, DeepSeek-V3.2 fp8, Kimi-Linear bf16")
    p.add_argument("--max-num-seqs", type=int, default=None, metavar="B",
                   help="with --max-model-len: also print what the serving engine allocates for B slots (key 'engine': "
                        "pages per pool, cache_bytes_per_device, max_cached_tokens), the figures its /stats reports")
    p.add_argument("--max-model-len", type=int, default=None, metavar="L", help="tokens per engine slot")
    p.add_argument("--num-blocks", type=int, default=None, help="pages per MLA pool per DCP rank (engine default: "
                   "every slot at --max-model-len)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="activation dtype (KDA conv tails)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    a = p.parse_args(argv)
    try:
        cfg = load_config(a.config)
        result = plan(cfg, kv_dtype=a.kv_dtype, index_dtype=a.index_dtype, mesh=parse_mesh(a.mesh), dcp=a.dcp,
                      hbm_gb=a.hbm_gb, weights_dtype=a.weights_dtype,
                      gpu_memory_utilization=a.gpu_memory_utilization)
        if (a.max_num_seqs is None) != (a.max_model_len is None):
            raise ValueError("--max-num-seqs and --max-model-len go together (the engine's slots)")
        if a.max_num_seqs is not None:
            tp, dp = parse_mesh(a.mesh)
            layout = CacheLayout(cfg, kv_dtype=a.kv_dtype, index_dtype=a.index_dtype,
                                 activation_bytes=2 if a.dtype == "bf16" else 4)
            result["engine"] = dataclasses.asdict(allocate(
                layout, max_num_seqs=a.max_num_seqs, max_model_len=a.max_model_len, num_blocks=a.num_blocks,
                tensor=tp, data=dp, dcp=a.dcp))
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(result))
        return 0
    r = result
    print(f"{a.config} ({r['architecture']})")
    print(f"  parameters        total {_human(r['params_total'])}   active per token {_human(r['params_active'])}")
    print(f"  weights           {r['weight_bytes'] / 1e9:.1f} GB ({r['weights_dtype']}), "
          f"{r['weight_bytes_per_device'] / 1e9:.1f} GB per device on mesh {r['mesh']}")
    latent = (f"latent {r['latent_bytes_per_token']:,} B ({r['latent_bytes_per_token_layer']} B {r['kv_dtype']} "
              f"per layer)")
    if r["index_dtype"] is None:
        parts = f"{latent}; no index key (no DSA indexer)"
    else:
        parts = (f"{latent} + index key {r['index_bytes_per_token']:,} B ({r['index_bytes_per_token_layer']} B "
                 f"{r['index_dtype']} per layer)")
    print(f"  cache per token   {r['kv_bytes_per_token']:,} B over {r['mla_layers']} MLA layers = {parts}")
    print(f"  state per seq     {r['state_bytes_per_sequence'] / 2**20:,.1f} MiB (KDA)")
    if not r["fits"]:
        print(f"  capacity          the weights do not fit {r['hbm_gb_per_device']} GB per device on this mesh")
    else:
        tp = int(r["mesh"].split("x")[0])
        mode = (f"DCP{r['dcp']} (tokens split {r['dcp']} ways)" if r["dcp"] > 1 else
                f"TP{tp} (latent replicated on every device)" if tp > 1 else "one device per model replica")
        print(f"  capacity          {mode}: {r['max_cached_tokens']:,} cached tokens, "
              f"{r['max_1m_sequences']} concurrent 1M-token sequences")
    if "engine" in r:
        e = r["engine"]
        print(f"  engine            {a.max_num_seqs} slots x {a.max_model_len} tokens: {e['num_blocks']} pages per "
              f"pool{' per DCP rank' if a.dcp > 1 else ''}, {e['cache_bytes_per_device'] / 2**20:,.1f} MiB of cache "
              f"per device, {e['max_cached_tokens']:,} cached tokens; a prefix-cache checkpoint "
              f"{e['checkpoint_bytes_per_device'] / 2**20:,.1f} MiB per device")
    return 0


if __name__ == "__main__":
    sys.exit(main())
