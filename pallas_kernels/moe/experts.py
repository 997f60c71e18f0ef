"""Routed-expert weight formats: the pytrees a MoE layer holds and `sharding.moe.routed_experts` takes, one type
per format.

| format               | each of gate `[K -> F]`, up `[K -> F]`, down `[F -> K]` (input -> output width)          |
|----------------------|------------------------------------------------------------------------------------------|
| `DenseExperts`       | float `[E, in, out]`                                                                     |
| `MXFP4Experts`       | `mxfp4.MXFP4Weight`: packed uint8 `[E, out, in/2]`, E8M0 scale uint8 `[E, out, in/32]`   |
| `MosaicMXFP4Experts` | `mgpu_mxfp4.PreparedWeight`: placed codes, transposed scales, per-expert exponent offsets |

(K: the experts' input width — the hidden or latent width; F: the expert FFN's width.) Dense weights are K-major
(`x @ w`); MXFP4 weights are the checkpoint's own `[out, in]` arrays, decoded inside the kernels tile by tile;
the Mosaic layout is the same values laid out once for the Mosaic GPU MXFP4 kernel (`prepare`, on a GPU at load),
gate's and up's output columns in the down matmul's x-plane order (`mgpu_mxfp4.ffn_out_orders`). The three formats
hold the same numbers: `to_mxfp4` turns a Mosaic one back exactly, and `ops.expert_ffn` takes each weight in any of
them (backends without a kernel for a layout turn it back per call).

Leaves are whatever the caller holds (arrays, `jax.ShapeDtypeStruct`s, or a framework's parameter boxes with
`.shape` / `.dtype`); shapes are read, never materialised.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Union

import jax

import pallas_kernels.moe.mgpu_mxfp4 as _mgpu_mx  # not `from . import`: see moe/ops.py
import pallas_kernels.moe.mxfp4 as mx


def _pytree(cls):
    """A frozen dataclass whose fields are all pytree children."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    return jax.tree_util.register_dataclass(cls, data_fields=[f.name for f in dataclasses.fields(cls)],
                                            meta_fields=[])


@_pytree
class DenseExperts:
    """Float expert weights: gate, up `[E, K, F]`, down `[E, F, K]`."""

    gate: Any
    up: Any
    down: Any

    quantized = False

    @property
    def num_experts(self) -> int:
        return self.gate.shape[0]

    def weights(self) -> tuple:
        """(gate, up, down) as `ops.expert_ffn` takes them."""
        return self.gate, self.up, self.down


@_pytree
class MXFP4Experts:
    """MXFP4 expert weights in the checkpoint's layout: each an `mxfp4.MXFP4Weight` (packed `[E, N, K/2]` uint8,
    E8M0 scale `[E, N, K/32]` uint8) of the matmul's K (input) and N (output) widths."""

    gate: mx.MXFP4Weight
    up: mx.MXFP4Weight
    down: mx.MXFP4Weight

    quantized = True

    @property
    def num_experts(self) -> int:
        return self.gate.packed.shape[0]

    def weights(self) -> tuple:
        return self.gate, self.up, self.down

    @staticmethod
    def like(dense: DenseExperts) -> "MXFP4Experts":
        """The abstract (`jax.ShapeDtypeStruct`) MXFP4 form of `dense`'s shapes: what a loader fills with a
        checkpoint's packed codes and scales. Raises ValueError where an input width is not whole MXFP4 groups."""
        def one(name: str, w) -> mx.MXFP4Weight:
            E, K, N = w.shape
            if K % mx.GROUP:
                raise ValueError(f"MXFP4 experts need the input width of {name} ({K}) to be a multiple of "
                                 f"{mx.GROUP}")
            u8 = jax.numpy.uint8
            return mx.MXFP4Weight(jax.ShapeDtypeStruct((E, N, K // 2), u8),
                                  jax.ShapeDtypeStruct((E, N, K // mx.GROUP), u8))

        return MXFP4Experts(one("gate", dense.gate), one("up", dense.up), one("down", dense.down))


@_pytree
class MosaicMXFP4Experts:
    """MXFP4 expert weights laid out for the Mosaic GPU MXFP4 kernel: each an `mgpu_mxfp4.PreparedWeight`
    ("placed": codes `[E, N, K/2]` uint8 with each word's bits permuted, scales `[E, K/32, N]` uint8, output
    factors `[E]` float32); gate and up in `ffn_out_orders`' output order."""

    gate: _mgpu_mx.PreparedWeight
    up: _mgpu_mx.PreparedWeight
    down: _mgpu_mx.PreparedWeight

    quantized = True

    @property
    def num_experts(self) -> int:
        return self.gate.codes.shape[0]

    def weights(self) -> tuple:
        return self.gate, self.up, self.down

    def to_mxfp4(self) -> MXFP4Experts:
        """The checkpoint's layout again, bit for bit (`mgpu_mxfp4.unprepare_weight`)."""
        return MXFP4Experts(*(_mgpu_mx.unprepare_weight(w) for w in self.weights()))


ExpertWeights = Union[DenseExperts, MXFP4Experts, MosaicMXFP4Experts]
FORMATS = (DenseExperts, MXFP4Experts, MosaicMXFP4Experts)


def mosaic_takes(experts: MXFP4Experts) -> bool:
    """Whether the Mosaic GPU MXFP4 kernel takes these weights' shapes: every input width a multiple of 128 and
    every output width of 64 (`mgpu_mxfp4.COLS`)."""
    return all(w.in_features % 128 == 0 and w.out_features % _mgpu_mx.COLS == 0 for w in experts.weights())


def prepare(experts: ExpertWeights, backend: str) -> ExpertWeights:
    """The format that MoE `backend` ("reference" | "gpu" | "mgpu" | "tpu", resolved, not interpreted) runs
    `experts` from best: MXFP4 experts become `MosaicMXFP4Experts` for the "gpu" backend where the Mosaic kernel
    takes their shapes; everything else is returned as it is. Meant to run once per layer, when weights are loaded
    (the result holds the same values; the old arrays are the caller's to drop)."""
    if backend != "gpu" or not isinstance(experts, MXFP4Experts) or not mosaic_takes(experts):
        return experts
    orders = _mgpu_mx.ffn_out_orders(experts.gate.out_features)
    return MosaicMXFP4Experts(*(_mgpu_mx.prepare_weight(w, "placed", o) for w, o in zip(experts.weights(), orders)))
