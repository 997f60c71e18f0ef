"""Cache layout and byte accounting (docs/model.md §10): what one token costs in every MLA layer and what one sequence
costs in every KDA layer, for each storage format. The planner and the engine's allocator both read these figures, so
there is exactly one formula.

Per token per MLA layer (latent R = 512, rope 64 at full size):
  latent fp32   4·(R + rope)  (unquantised: float32 models, references)  = 2304 B
  latent bf16   2·(R + rope)                                = 1152 B
  latent fp8    R + rope (e4m3; the rope part too)          =  576 B
  latent nvfp4  R/2 packed e2m1 + R/16 E4M3 scales + rope fp8 = 352 B
  index key fp32   4·d, bf16 2·d
  index key fp8    d + 4 (one fp32 scale per 128 values)     =  132 B
  index key mxfp4  d/2 + d/32 (one E8M0 scale per 32)        =   68 B
Per sequence per KDA layer: state H·d·d fp32 plus conv tails of (K−1) tokens × 3P in the activation dtype.

The paged cache (`kimi_jax.paged_cache`) allocates MLA rows in pages of PAGE_TOKENS tokens; a sequence of n tokens
holds ceil(n / PAGE_TOKENS) pages in every MLA layer (`blocks_for_tokens`, `sequence_bytes`). The concrete storage
formats (`kimi_jax.quant`) are checked against the figures here, never the other way round.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import ModelConfig

KV_DTYPES = ("fp32", "bf16", "fp8", "nvfp4")
INDEX_DTYPES = ("fp32", "bf16", "fp8", "mxfp4")
PAGE_TOKENS = 64


def latent_bytes_per_token(latent: int, rope: int, kv_dtype: str) -> int:
    """Bytes of one cached latent row `[latent | k_rope]` in one layer."""
    if kv_dtype == "fp32":
        return 4 * (latent + rope)
    if kv_dtype == "bf16":
        return 2 * (latent + rope)
    if kv_dtype == "fp8":
        return latent + rope
    if kv_dtype == "nvfp4":
        if latent % 16:
            raise ValueError(f"NVFP4 needs the latent width to be a multiple of 16, got {latent}")
        return latent // 2 + latent // 16 + rope
    raise ValueError(f"unknown kv dtype {kv_dtype!r}; choose one of {KV_DTYPES}")


def index_key_bytes_per_token(dim: int, index_dtype: str) -> int:
    """Bytes of one cached index key in one layer."""
    if index_dtype == "fp32":
        return 4 * dim
    if index_dtype == "bf16":
        return 2 * dim
    if index_dtype == "fp8":
        return dim + 4 * -(-dim // 128)
    if index_dtype == "mxfp4":
        if dim % 32:
            raise ValueError(f"MXFP4 needs the index dim to be a multiple of 32, got {dim}")
        return dim // 2 + dim // 32
    raise ValueError(f"unknown index dtype {index_dtype!r}; choose one of {INDEX_DTYPES}")


@dataclass(frozen=True)
class CacheLayout:
    """The per-token and per-sequence byte costs of one model's inference state."""

    config: ModelConfig
    kv_dtype: str = "fp8"
    index_dtype: str = "fp8"
    activation_bytes: int = 2

    @property
    def latent_bytes_per_token_layer(self) -> int:
        m = self.config.mla
        return latent_bytes_per_token(m.kv_lora_rank, m.qk_rope_head_dim, self.kv_dtype)

    @property
    def index_bytes_per_token_layer(self) -> int:
        ix = self.config.indexer
        return 0 if ix is None else index_key_bytes_per_token(ix.head_dim, self.index_dtype)

    @property
    def kv_bytes_per_token(self) -> int:
        """All MLA layers together: latent + index key."""
        n = len(self.config.mla_layers)
        return n * (self.latent_bytes_per_token_layer + self.index_bytes_per_token_layer)

    @property
    def kda_state_bytes_per_layer(self) -> int:
        k = self.config.kda
        if k is None:
            return 0
        return k.num_heads * k.head_dim * k.head_dim * 4 + (k.conv_kernel - 1) * 3 * k.proj_dim * self.activation_bytes

    @property
    def state_bytes_per_sequence(self) -> int:
        """Fixed per-sequence state: every KDA layer's recurrent state and conv tails."""
        return len(self.config.kda_layers) * self.kda_state_bytes_per_layer

    @property
    def page_bytes(self) -> int:
        """One page (PAGE_TOKENS tokens) in every MLA layer together."""
        return PAGE_TOKENS * self.kv_bytes_per_token

    @property
    def layer_bytes_per_token(self) -> int:
        """One token in one MLA layer: latent row + index key."""
        return self.latent_bytes_per_token_layer + self.index_bytes_per_token_layer

    @property
    def layer_page_bytes(self) -> int:
        """One page in one MLA layer's pool."""
        return PAGE_TOKENS * self.layer_bytes_per_token

    @staticmethod
    def blocks_for_tokens(tokens: int) -> int:
        """Pages a sequence of `tokens` tokens occupies in each MLA layer."""
        if tokens < 0:
            raise ValueError(f"token count must be >= 0, got {tokens}")
        return -(-tokens // PAGE_TOKENS)

    def sequence_bytes(self, tokens: int) -> int:
        """Everything one sequence of `tokens` tokens holds: its MLA pages (rounded up to whole pages) plus the
        fixed KDA state."""
        return self.blocks_for_tokens(tokens) * self.page_bytes + self.state_bytes_per_sequence


@dataclass(frozen=True)
class EngineAllocation:
    """What the serving engine allocates for its cache on each device (`allocate` computes it; the engine's
    `ModelRunner` places exactly these buffers and `/stats` reports the same `cache_bytes_per_device`)."""

    num_blocks: int  # pages per MLA pool per DCP rank, the null page included
    max_blocks: int  # block-table entries of one sequence at max_model_len
    block_tokens: int  # sequence positions one table entry covers (PAGE_TOKENS · dcp)
    cache_bytes_per_device: int  # KDA states + conv tails + MLA pools + lengths + tables on the most loaded device
    max_cached_tokens: int  # positions the pools hold across the DCP ranks, the null pages aside
    # one prefix-cache checkpoint (a batch-1 copy of a sequence's length, table, KDA states and conv tails) on the
    # most loaded device; the engine holds up to --prefix-cache-checkpoints of them besides the cache above
    checkpoint_bytes_per_device: int = 0


def _split(n: int, ways: int) -> int:
    """`n` divided over `ways` devices when it divides, else whole (the placement rule of `sharding.partition`)."""
    return n // ways if ways > 1 and n % ways == 0 else n


def allocate(layout: CacheLayout, *, max_num_seqs: int, max_model_len: int, num_blocks: int | None = None,
             tensor: int = 1, data: int = 1, dcp: int = 1) -> EngineAllocation:
    """The engine's cache for `max_num_seqs` slots of `max_model_len` tokens on a mesh of `tensor` × `data` devices
    (any context axis adds nothing here but the DCP split), with decode context parallelism over `dcp` ranks.

    Placement (docs/serving.md, "Sharded serving"): KDA states `[B, H, dk, dv]` float32 split their rows over data
    and their heads over tensor (their value columns when the heads do not divide), conv tails `[B, K−1, H·d]` their
    rows over data and channels over tensor; each MLA pool holds `num_blocks` pages per DCP rank (the pools whole on
    every device without DCP); lengths and block tables are whole everywhere."""
    cfg, B = layout.config, int(max_num_seqs)
    block_tokens = PAGE_TOKENS * int(dcp)
    max_blocks = -(-int(max_model_len) // block_tokens)
    if num_blocks is None:
        num_blocks = 1 + B * max_blocks

    def per_sequence(batch: int) -> int:  # lengths, block tables, KDA states and conv tails of `batch` rows
        rows = _split(batch, data)
        total = 4 * batch + 4 * batch * max_blocks
        k = cfg.kda
        if k is not None:
            H, d, P = k.num_heads, k.head_dim, k.proj_dim
            state = rows * H * d * d * 4
            state //= tensor if tensor > 1 and (H % tensor == 0 or d % tensor == 0) else 1
            tails = 3 * rows * (k.conv_kernel - 1) * _split(P, tensor) * layout.activation_bytes
            total += len(cfg.kda_layers) * (state + tails)
        return total

    total = per_sequence(B) + len(cfg.mla_layers) * (int(num_blocks) * layout.layer_page_bytes + 4)  # + latent scale
    return EngineAllocation(int(num_blocks), max_blocks, block_tokens, total,
                            (int(num_blocks) - 1) * block_tokens, per_sequence(1))
