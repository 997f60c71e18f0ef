"""FFNs (docs/model.md §7): the dense gated MLP, the sigmoid router with a selection-only bias, and the (latent) MoE."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.moe import experts as expert_formats
from pallas_kernels.moe import ops as moe_ops
from pallas_kernels.moe.experts import FORMATS, DenseExperts, ExpertWeights
from pallas_kernels.moe.routing import route, router_logits  # noqa: F401  (route: this module's API)
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


class MoE(nnx.Module):
    """Routed experts + shared experts; with `latent_size`, routed experts run in a latent space (K3).

    The routed experts' weights are `self.experts`, one of the MoE kernels' formats
    (`pallas_kernels.moe.experts`), as `nnx.Param` leaves: `DenseExperts` (gate, up `[E, width, F]`, down
    `[E, F, width]` in `dtype`) as built; `MXFP4Experts` (the checkpoint's packed codes and E8M0 scales) where a
    loader sets them with `set_experts`; `MosaicMXFP4Experts` after `prepare_experts` on a GPU. The forward hands
    whichever it holds to `sharding.moe.routed_experts`: one call path for every format.
    """

    def __init__(self, hidden: int, cfg: MoEConfig, act, eps: float, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.cfg = cfg
        self.act = act
        E, F = cfg.num_experts, cfg.intermediate_size
        width = cfg.latent_size or hidden
        self.gate = nnx.Param(normal_init(rngs, (hidden, E), hidden ** -0.5, jnp.float32))  # router, [D, E]
        self.e_score_correction_bias = nnx.Param(normal_init(rngs, (E,), 0.05, jnp.float32))
        self.experts = nnx.data(DenseExperts(
            gate=nnx.Param(normal_init(rngs, (E, width, F), width ** -0.5, dtype)),
            up=nnx.Param(normal_init(rngs, (E, width, F), width ** -0.5, dtype)),
            down=nnx.Param(normal_init(rngs, (E, F, width), F ** -0.5, dtype))))
        if cfg.latent_size:
            self.routed_expert_down_proj = Linear(hidden, width, rngs=rngs, dtype=dtype)
            self.routed_expert_up_proj = Linear(width, hidden, rngs=rngs, dtype=dtype)
            self.routed_expert_norm = RMSNorm(width, eps, rngs=rngs, dtype=dtype) if cfg.latent_norm else None
        self.shared_experts = (DenseMLP(hidden, cfg.shared_intermediate_size, act, rngs=rngs, dtype=dtype)
                               if cfg.num_shared_experts else None)

    def expert_weights(self) -> ExpertWeights:
        """The routed experts' weights in their format, as values (arrays, or `ShapeDtypeStruct`s when abstract)."""
        return jax.tree.map(lambda p: p.get_value(), self.experts, is_leaf=lambda x: isinstance(x, nnx.Variable))

    def set_experts(self, experts: ExpertWeights) -> None:
        """Hold `experts` (arrays or `ShapeDtypeStruct`s, in any format of `pallas_kernels.moe.experts`) as the
        routed experts' parameters, in place of the current ones (for a loader, and `prepare_experts`)."""
        if not isinstance(experts, FORMATS):
            raise TypeError(f"routed experts must be one of {[f.__name__ for f in FORMATS]}, got "
                            f"{type(experts).__name__}")
        if experts.num_experts != self.cfg.num_experts:
            raise ValueError(f"{experts.num_experts} routed experts for a layer of {self.cfg.num_experts}")
        self.experts = jax.tree.map(nnx.Param, experts)

    def __call__(self, x_btd, ctx: ForwardContext = ForwardContext()):
        cfg = self.cfg
        B, T, D = x_btd.shape
        x = x_btd.reshape(B * T, D)
        # the router's matmul in XLA; the selection as one kernel where the MoE kernels run on a GPU
        w, idx = moe_sharded.select_experts(ctx, router_logits(x, self.gate[...]), self.e_score_correction_bias[...],
                                            cfg, quantized=self.experts.quantized)
        xr = self.routed_expert_down_proj(x) if cfg.latent_size else x
        # where each expert lives (`sharding.moe`): GSPMD cannot split a kernel's custom call
        y = moe_sharded.routed_experts(ctx, xr, idx, w, self.expert_weights(), self.act,
                                       num_experts=cfg.num_experts)
        y = y.astype(x.dtype)
        if cfg.latent_size:
            if self.routed_expert_norm is not None:
                y = self.routed_expert_norm(y, ctx)
            y = self.routed_expert_up_proj(y)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y.reshape(B, T, D)


def moe_layers(module):
    """(path, `MoE`) for every MoE layer inside `module`, in graph order."""
    iter_modules = getattr(nnx, "iter_modules", None) or (lambda mod: mod.iter_modules())  # flax >= 0.12 / older
    return [(path, m) for path, m in iter_modules(module) if isinstance(m, MoE)]


def prepare_experts(module, kernels: KernelConfig, platform: Optional[str] = None) -> int:
    """Lay every MoE layer's routed experts out for the MoE kernels that `kernels` run on `platform` (None: this
    host's), once, when the weights are loaded (`pallas_kernels.moe.experts.prepare`: MXFP4 experts become the
    Mosaic GPU kernel's layout for the GPU backend). Interpreted kernels keep the checkpoint's layout. A layer's
    old arrays are freed once its new ones are set, so the extra memory is one layer's experts at most. Returns how
    many layers changed format."""
    if kernels.moe_interpret:
        return 0
    changed = 0
    for _, m in moe_layers(module):
        old = m.expert_weights()
        backend = moe_ops.resolve_backend(kernels.moe, quantized=old.quantized, platform=platform)
        new = expert_formats.prepare(old, backend)
        if new is not old:
            del old
            m.set_experts(new)
            changed += 1
    return changed
