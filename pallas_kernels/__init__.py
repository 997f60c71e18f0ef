"""Pallas kernels behind one small op interface per family (docs/kernels.md): `pallas_kernels.kda.chunk / .recurrent`,
`pallas_kernels.indexer.decode / .prefill`, `pallas_kernels.sparse_mla.decode / .prefill / .sparse_mla` and
`pallas_kernels.moe.grouped_matmul / .expert_ffn`. Each entry point picks a backend (Pallas Mosaic TPU, native Triton
through jax-triton or Pallas Mosaic GPU on GPUs, or the plain-jnp reference it is tested against) and keeps the
reference beside the kernels in its folder."""
