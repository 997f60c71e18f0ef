"""MoE expert computation: grouped matmuls over expert-sorted rows (bf16 or MXFP4 weights) and the routed expert FFN
(`ops`: entry points and backend choice; `reference`: jnp; `gpu_triton`: the native Triton kernel; `tpu`: the
Pallas Mosaic TPU kernel; `mgpu_mxfp4`: the Mosaic GPU MXFP4 kernel, which `ops` runs for weights prepared with
`mgpu_mxfp4.prepare_weight`; `mgpu_ragged`: JAX's bundled Mosaic GPU ragged_dot; `mxfp4`: the weight
format and its decoders; `experts`: the routed experts' weight formats as one pytree per layer; `schedule`: row
tiles per expert)."""

from .ops import (combine, dispatch_plan, expert_ffn, expert_ffn_sorted, gated_grouped_matmul, grouped_matmul,  # noqa: F401
                  resolve_backend, routed_experts, sort_tokens)
