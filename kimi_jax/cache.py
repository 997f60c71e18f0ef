"""Cache layout and byte accounting (SPEC §10): what one token costs in every MLA layer and what one sequence costs
in every KDA layer, for each storage format. The planner and the engine's allocator both read these figures, so
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
