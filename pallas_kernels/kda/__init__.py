"""KDA op family: `reference` (the definition), `ops` (public entry point: chunk / recurrent, backend choice),
`tpu` (Pallas Mosaic TPU kernels), `gpu_triton` (native Triton GPU kernels, launched through jax-triton),
`chunk_math` (shared intra-chunk math)."""

from .ops import chunk, recurrent, recurrent_donated, resolve_backend  # noqa: F401
