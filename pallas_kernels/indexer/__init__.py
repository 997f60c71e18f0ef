"""DSA lightning indexer over the paged index-key cache: `decode` / `prefill` -> top-k key indices per query
(`paged`: entry points, backend choice, the jnp reference; `gpu_triton` / `tpu`: the score kernels)."""

from .paged import decode, indices_to_mask, prefill, query_chunk, select_topk, topk_indices  # noqa: F401
