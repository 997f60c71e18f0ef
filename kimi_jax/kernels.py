"""Which kernel implementation each op family runs: execution policy as data, separate from the architecture.

"auto" picks per platform inside each op family's entry point (`pallas_kernels.<family>.ops.resolve_backend`):
the Pallas TPU kernel on TPU, the GPU kernel on GPU, the plain-jnp reference elsewhere (CPU). "reference" forces
the jnp definition everywhere. The interpret variants run a kernel's code on CPU (tests).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KernelConfig:
    kda: str = "auto"  # pallas_kernels.kda.ops: auto | reference | gpu | tpu | gpu_interpret | tpu_interpret
    moe: str = "auto"  # pallas_kernels.moe.ops: auto | reference | gpu | mgpu | tpu
    moe_interpret: bool = False  # run the chosen MoE kernel through the Pallas interpreter (CPU tests)
    # pallas_kernels.indexer.paged / mla.sparse (the paged MLA path): auto | reference | gpu | tpu | gpu_interpret |
    # tpu_interpret. Under "auto" the environment variable KIMI_JAX_DSA_BACKEND=reference is an operator's override.
    dsa: str = "auto"
    # DSA products: "exact" (≈ fp32 against the dequantised cache, hi/lo split operands) or "storage" (the GPU
    # kernels' single-pass settings, within the quantised cache formats' 5e-3 bar: 2.5-3x faster on the H200 at
    # B = 32, bench/RESULTS.md session 7; fp8 pages with ≤ 16 heads per device and ≥ 16 sequences then run the
    # one-launch Mosaic GPU sparse-MLA kernel, session 15). Only the GPU kernels differ.
    dsa_precision: str = "exact"

    def __post_init__(self):
        from pallas_kernels.paged import check_precision

        check_precision(self.dsa_precision)  # a typo fails here, not at the first decode step

    @staticmethod
    def reference() -> "KernelConfig":
        return KernelConfig(kda="reference", moe="reference", dsa="reference")
