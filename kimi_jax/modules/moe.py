"""FFNs (SPEC §7): the dense gated MLP, the sigmoid router with a selection-only bias, and the (latent) MoE."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from pallas_kernels.moe import mgpu_mxfp4 as mgpu_mx
from pallas_kernels.moe import mxfp4 as mx
from pallas_kernels.moe import ops as moe_ops
from pallas_kernels.moe.routing import route
from sharding import moe as moe_sharded
from sharding.context import ForwardContext, KernelConfig

from ..config import MoEConfig
from .layers import Linear, RMSNorm, normal_init

class DenseMLP(nnx.Module):
    """down(act(gate(x), up(x)))."""

    def __init__(self, hidden: int, intermediate: int, act, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.act = act
        self.gate_proj = Linear(hidden, intermediate, rngs=rngs, dtype=dtype)
        self.up_proj = Linear(hidden, intermediate, rngs=rngs, dtype=dtype)
        self.down_proj = Linear(intermediate, hidden, rngs=rngs, dtype=dtype)

    def __call__(self, x):
        h = self.act(self.gate_proj(x, out_dtype=jnp.float32), self.up_proj(x, out_dtype=jnp.float32))
        return self.down_proj(h.astype(x.dtype))


EXPERT_WEIGHTS = ("w1", "w3", "w2")  # gate, up, down


class MoE(nnx.Module):
    """Routed experts + shared experts; with `latent_size`, routed experts run in a latent space (K3).

    Routed expert weights come in one of two formats (`expert_format`):
    * "plain": `w1`, `w3` `[E, width, F]` and `w2` `[E, F, width]` in `dtype` (K-major, `[E, K, N]`);
    * "mxfp4" (after `use_mxfp4_experts`, how a checkpoint with MXFP4 experts loads): `<w>_packed` uint8
      `[E, N, K/2]` and `<w>_scale` uint8 E8M0 `[E, N, K/32]`, the checkpoint's own arrays. The forward hands them
      to the MoE kernels, which decode them tile by tile (the reference backend dequantises per call inside the
      jitted forward); no dequantised copy is ever stored;
    * "mxfp4_mosaic" (after `use_mosaic_experts`, which `Model` calls on a GPU): the same weights laid out once for
      the Mosaic GPU MXFP4 kernel (`mgpu_mxfp4.prepare_ffn_weights`, "placed"): `<w>_codes` uint8 `[E, N, K/2]`
      (each word's bits permuted), `<w>_scales_t` uint8 `[E, K/32, N]`, `<w>_exp_offset` int32 `[E]`; gate's and
      up's N axis in the down matmul's x-plane order (`mosaic_out_orders`). Same values, exactly
      (`mgpu_mxfp4.unprepare_weight` gives the checkpoint's arrays back).
    """

    def __init__(self, hidden: int, cfg: MoEConfig, act, eps: float, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.cfg = cfg
        self.act = act
        E, F = cfg.num_experts, cfg.intermediate_size
        width = cfg.latent_size or hidden
        self.gate = nnx.Param(normal_init(rngs, (hidden, E), hidden ** -0.5, jnp.float32))  # router, [D, E]
        self.e_score_correction_bias = nnx.Param(normal_init(rngs, (E,), 0.05, jnp.float32))
        self.w1 = nnx.Param(normal_init(rngs, (E, width, F), width ** -0.5, dtype))  # gate
        self.w3 = nnx.Param(normal_init(rngs, (E, width, F), width ** -0.5, dtype))  # up
        self.w2 = nnx.Param(normal_init(rngs, (E, F, width), F ** -0.5, dtype))  # down
        self.expert_format = "plain"
        if cfg.latent_size:
            self.routed_expert_down_proj = Linear(hidden, width, rngs=rngs, dtype=dtype)
            self.routed_expert_up_proj = Linear(width, hidden, rngs=rngs, dtype=dtype)
            self.routed_expert_norm = RMSNorm(width, eps, rngs=rngs, dtype=dtype) if cfg.latent_norm else None
        self.shared_experts = (DenseMLP(hidden, cfg.shared_intermediate_size, act, rngs=rngs, dtype=dtype)
                               if cfg.num_shared_experts else None)

    def use_mxfp4_experts(self):
        """Swap the plain expert arrays for MXFP4 parameters (`<w>_packed` uint8 `[E, N, K/2]`, `<w>_scale` uint8
        `[E, N, K/32]`), zero-filled. Meant for an abstract module (`nnx.eval_shape`) that a loader then fills;
        the parameter paths equal the converted checkpoint's stored names (`layers.L.block_sparse_moe.w1_packed`)."""
        if self.expert_format == "mxfp4":
            return
        for name in EXPERT_WEIGHTS:
            E, K, N = getattr(self, name).shape
            if K % mx.GROUP:
                raise ValueError(f"MXFP4 experts need the input width of {name} ({K}) to be a multiple of {mx.GROUP}")
            delattr(self, name)
            setattr(self, name + "_packed", nnx.Param(jnp.zeros((E, N, K // 2), jnp.uint8)))
            setattr(self, name + "_scale", nnx.Param(jnp.zeros((E, N, K // mx.GROUP), jnp.uint8)))
        self.expert_format = "mxfp4"

    def use_mosaic_experts(self) -> bool:
        """Re-lay MXFP4 expert parameters out for the Mosaic GPU MXFP4 kernel (format "mxfp4_mosaic"), once, where
        the kernel takes their shapes (K a multiple of 128, N of 64 for all three). The MoE ops then run the expert
        FFN in one tile layout on that kernel (`mgpu_mxfp4.expert_ffn_tiled`) on a GPU, and turn the weights back
        (exactly) on any other backend. Returns whether the parameters were re-laid."""
        if self.expert_format != "mxfp4":
            return False
        weights = self.expert_weights()
        if not all(w.in_features % 128 == 0 and w.out_features % mgpu_mx.COLS == 0 for w in weights):
            return False
        # gate and up with their output columns in down's x-plane order (h goes from one kernel to the next as is,
        # `prepare_ffn_weights`); one weight at a time, so each old array is freed as its replacement is made
        orders = mgpu_mx.ffn_out_orders(weights[0].out_features)
        del weights
        for name, order in zip(EXPERT_WEIGHTS, orders):
            w = self._mxfp4_weight(name)
            p = mgpu_mx.prepare_weight(w, "placed", order)
            del w
            delattr(self, name + "_packed")
            delattr(self, name + "_scale")
            setattr(self, name + "_codes", nnx.Param(p.codes))
            setattr(self, name + "_scales_t", nnx.Param(p.scales_t))
            setattr(self, name + "_exp_offset", nnx.Param(p.exp_offset))
        self.expert_format = "mxfp4_mosaic"
        self.mosaic_out_orders = orders
        return True

    def expert_weights(self):
        """(gate, up, down): dense `[E, K, N]` arrays, `mx.MXFP4Weight`s or `mgpu_mxfp4.PreparedWeight`s, as the
        MoE ops take them."""
        if self.expert_format == "mxfp4_mosaic":
            return tuple(mgpu_mx.PreparedWeight(getattr(self, n + "_codes")[...], getattr(self, n + "_scales_t")[...],
                                                getattr(self, n + "_exp_offset")[...], layout="placed", out_order=o)
                         for n, o in zip(EXPERT_WEIGHTS, self.mosaic_out_orders))
        if self.expert_format == "mxfp4":
            return tuple(self._mxfp4_weight(n) for n in EXPERT_WEIGHTS)
        return tuple(getattr(self, n)[...] for n in EXPERT_WEIGHTS)

    def _mxfp4_weight(self, name: str) -> mx.MXFP4Weight:
        """Expert weight `name` ("w1", …) as the checkpoint's MXFP4 codes and E8M0 scales."""
        return mx.MXFP4Weight(getattr(self, name + "_packed")[...], getattr(self, name + "_scale")[...])

    def __call__(self, x_btd, ctx: ForwardContext = ForwardContext()):
        cfg = self.cfg
        B, T, D = x_btd.shape
        x = x_btd.reshape(B * T, D)
        w, idx = route(x, self.gate[...], self.e_score_correction_bias[...], cfg)
        xr = self.routed_expert_down_proj(x) if cfg.latent_size else x
        # where each expert lives (`sharding.moe`): GSPMD cannot split a kernel's custom call
        y = moe_sharded.routed_experts(ctx, xr, idx, w, *self.expert_weights(), self.act,
                                       num_experts=cfg.num_experts)
        y = y.astype(x.dtype)
        if cfg.latent_size:
            if self.routed_expert_norm is not None:
                y = self.routed_expert_norm(y)
            y = self.routed_expert_up_proj(y)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y.reshape(B, T, D)


def moe_layers(module):
    """(path, `MoE`) for every MoE layer inside `module`, in graph order."""
    iter_modules = getattr(nnx, "iter_modules", None) or (lambda mod: mod.iter_modules())  # flax >= 0.12 / older
    return [(path, m) for path, m in iter_modules(module) if isinstance(m, MoE)]


def use_mosaic_experts(module, kernels: KernelConfig = KernelConfig()) -> int:
    """`MoE.use_mosaic_experts` for every MoE layer of `module` when `kernels.moe` resolves to the GPU kernels (and
    is not interpreted). Meant for a GPU host, right after loading; returns how many layers were re-laid."""
    if kernels.moe_interpret or moe_ops.resolve_backend(kernels.moe, quantized=True) != "gpu":
        return 0
    return sum(m.use_mosaic_experts() for _, m in moe_layers(module))
