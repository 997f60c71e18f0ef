"""`KernelConfig`: which implementation each op family runs (defined beside `ForwardContext` in
`sharding.context`, which carries it into every forward), and the attention precision a server or an export picks
for a model's dtype."""

from pallas_kernels.paged import DSA_PRECISIONS
from sharding.context import KernelConfig

__all__ = ["ATTENTION_PRECISIONS", "KernelConfig", "attention_precision"]

ATTENTION_PRECISIONS = ("auto",) + DSA_PRECISIONS


def attention_precision(flag: str, dtype) -> str:
    """`--attention-precision` (`KernelConfig.dsa_precision`) resolved against the model's activation dtype: "auto"
    is "storage" for bfloat16 (the products then take bf16 operands, as the model's own dtype asks) and "exact"
    otherwise; "exact" / "storage" are returned as given."""
    import numpy as np

    if flag not in ATTENTION_PRECISIONS:
        raise ValueError(f"attention precision must be one of {ATTENTION_PRECISIONS}, got {flag!r}")
    if flag != "auto":
        return flag
    return "storage" if np.dtype(dtype).name == "bfloat16" else "exact"
