"""DSA indexer over a paged key cache (SPEC §6): scores over all of a sequence's cached keys, top-k positions out.

score[b,t,s] = Σ_h w[b,t,h] · relu(q[b,t,h]·k[b,s])   for s ≤ pos[b,t]   (the caller folds Hi^-0.5·d^-0.5 into w)

Inputs: the index-key pool parts (each `[num_blocks, page, width]`) with their format object (anything with
`dequantize(parts) -> float32`, e.g. `kimi_jax.quant.IndexKeyFormat`), block tables `[B, max_blocks]`, and per query its
sequence position (`pos < 0`: a padding query, it selects nothing). Keys are gathered page by page in table order
and dequantised to float32; the scoring math is `pallas_kernels.indexer.reference.scores`.

Output: int32 `[B, T, topk]` positions, best first; −1 fills the tail when a query has fewer than `topk` allowed
keys (then every allowed key is selected). Selection = `reference.topk_mask` on untied scores. Tie rule: among equal
scores the EARLIER position wins (`lax.top_k` keeps the lower index first and keys are laid out by position).

Memory: the keys of the batch, `[B, max_blocks·page, d]` float32, plus per query chunk the per-head logits
`[B, Tc, Hi, S]` float32 (S = max_blocks·page) — the score buffer. Prefill processes queries in chunks of
Tc = max(1, max_score_bytes // (B·Hi·S·4)) rows, one chunk at a time, so the buffer stays ≤ max_score_bytes
(a single query row larger than the bound is still processed, one row at a time). Decode is one chunk.

`topk_indices` is the one public entry point; `backend="auto"` picks the implementation (only the jnp reference
exists so far, used on every platform).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from ..paged import gather_pages
from . import reference

DEFAULT_MAX_SCORE_BYTES = 256 << 20
BACKENDS = ("auto", "reference")


def query_chunk(batch: int, heads: int, keys: int, queries: int, max_score_bytes: int = DEFAULT_MAX_SCORE_BYTES) -> int:
    """Queries per chunk so the per-head logits `[B, Tc, Hi, S]` float32 fit in `max_score_bytes`."""
    per_query = batch * heads * keys * 4
    return int(max(1, min(queries, max_score_bytes // max(1, per_query))))


@partial(jax.jit, static_argnames=("fmt", "topk", "max_score_bytes"))
def _reference(q_bthd, w_bth, key_parts, block_tables, pos_bt, *, fmt, topk: int, max_score_bytes: int):
    keys_bsd = fmt.dequantize(gather_pages(key_parts, block_tables))
    B, T, H, _ = q_bthd.shape
    S = keys_bsd.shape[1]
    tc = query_chunk(B, H, S, T, max_score_bytes)
    n = -(-T // tc)
    pad = n * tc - T
    if pad:
        q_bthd = jnp.pad(q_bthd, ((0, 0), (0, pad), (0, 0), (0, 0)))
        w_bth = jnp.pad(w_bth, ((0, 0), (0, pad), (0, 0)))
        pos_bt = jnp.pad(pos_bt, ((0, 0), (0, pad)), constant_values=-1)

    def chunk(args):
        q, w, pos = args  # [B, tc, H, d], [B, tc, H], [B, tc]
        allowed = jnp.arange(S, dtype=jnp.int32)[None, None, :] <= pos[:, :, None]
        s = reference.scores(q, keys_bsd, w, allowed)
        if S < topk:
            s = jnp.pad(s, ((0, 0), (0, 0), (0, topk - S)), constant_values=-jnp.inf)
        vals, idx = jax.lax.top_k(s, topk)
        return jnp.where(vals > -jnp.inf, idx, -1).astype(jnp.int32)

    split = lambda x: jnp.moveaxis(x.reshape((B, n, tc) + x.shape[2:]), 1, 0)
    out = jax.lax.map(chunk, (split(q_bthd), split(w_bth), split(pos_bt)))  # [n, B, tc, topk]
    return jnp.moveaxis(out, 0, 1).reshape(B, n * tc, topk)[:, :T]


def topk_indices(q_bthd, w_bth, key_parts, block_tables, pos_bt, topk: int, *, fmt,
                 max_score_bytes: int = DEFAULT_MAX_SCORE_BYTES, backend: str = "auto"):
    """Top-k cached positions per query: q `[B, T, Hi, d]`, w `[B, T, Hi]` (scales folded in), pos `[B, T]` int
    (position of each query in its sequence; keys at positions ≤ pos are allowed). Returns int32 `[B, T, topk]`."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown indexer backend {backend!r}; choose one of {BACKENDS}")
    return _reference(q_bthd, w_bth, tuple(key_parts), block_tables, jnp.asarray(pos_bt, jnp.int32), fmt=fmt,
                      topk=topk, max_score_bytes=max_score_bytes)


def decode(q_bhd, w_bh, key_parts, block_tables, seq_lens, topk: int, *, fmt, **kw):
    """One query per sequence, at position seq_len − 1 (its own key already written). Returns `[B, topk]`."""
    pos = jnp.asarray(seq_lens, jnp.int32)[:, None] - 1
    return topk_indices(q_bhd[:, None], w_bh[:, None], key_parts, block_tables, pos, topk, fmt=fmt, **kw)[:, 0]


def prefill(q_bthd, w_bth, key_parts, block_tables, starts, topk: int, *, fmt, lengths=None, **kw):
    """T queries per sequence at positions start…start+T−1 (keys written first); rows t ≥ lengths[b] are padding
    (all −1). Returns `[B, T, topk]`."""
    B, T = q_bthd.shape[:2]
    t = jnp.arange(T, dtype=jnp.int32)[None]
    pos = jnp.asarray(starts, jnp.int32).reshape(B, 1) + t
    if lengths is not None:
        pos = jnp.where(t < jnp.asarray(lengths, jnp.int32).reshape(B, 1), pos, -1)
    return topk_indices(q_bthd, w_bth, key_parts, block_tables, pos, topk, fmt=fmt, **kw)


@partial(jax.jit, static_argnames="num_keys")
def indices_to_mask(idx_btk, num_keys: int):
    """Boolean `[B, T, S]` keep-mask of selected positions (−1 entries ignored): the additive-mask form."""
    hit = jax.nn.one_hot(jnp.where(idx_btk >= 0, idx_btk, num_keys), num_keys + 1, dtype=jnp.bool_)
    return jnp.any(hit, axis=-2)[..., :num_keys]
