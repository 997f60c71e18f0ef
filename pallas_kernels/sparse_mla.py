"""Sparse MLA op family under its family name (docs/kernels.md): absorbed attention over the top-k selected latent rows
of the paged cache. The code lives in `pallas_kernels.mla` (`sparse`: entry points, backend choice and the jnp
reference; `sparse_gpu_triton` / `sparse_mgpu` / `sparse_tpu`: the kernels); this module re-exports the entry
points."""

from .mla.sparse import decode, online_softmax_attention, prefill, sparse_absorbed_dense, sparse_mla  # noqa: F401
