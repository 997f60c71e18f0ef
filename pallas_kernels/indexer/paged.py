"""DSA indexer over a paged key cache (docs/model.md §6): scores over all of a sequence's cached keys, top-k positions
out.

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

`topk_indices` is the one public entry point; `backend` picks the implementation in one place
(`pallas_kernels.paged.resolve_dsa_backend`): "reference" (the jnp path above), "gpu" (`gpu_triton.py`, native
Triton through jax-triton), "tpu" (`tpu.py`, Mosaic TPU), "gpu_interpret" (the Triton kernel in Triton's
interpreter) and "tpu_interpret" (the TPU kernel in Pallas interpret mode), for CPU tests, "auto" (the platform's
kernel for decode, T = 1, else the reference); "triton" / "triton_interpret" are other names of "gpu" /
"gpu_interpret". The kernels write the decode score row `[B, S]` (keys dequantised in-kernel); top-k then runs in
XLA over that row (`select_topk`: `lax.top_k`, in two exact stages when the row is long). Prefill (T > 1) always
takes the reference path.
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp

# the package's own modules by their full name: `from . import x` would make this module import the package, whose
# __init__ imports this module (tests/test_import_layers.py counts that as a cycle)
import pallas_kernels.indexer.gpu_triton as gpu_triton
import pallas_kernels.indexer.reference as reference
import pallas_kernels.indexer.tpu as tpu

from ..paged import DSA_BACKENDS, canonical_dsa_backend, check_precision, gather_pages, resolve_dsa_backend

DEFAULT_MAX_SCORE_BYTES = 256 << 20
BACKENDS = DSA_BACKENDS
TOPK_GROUP = 16


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


@partial(jax.jit, static_argnames=("topk", "group"))
def select_topk(s_bs, topk: int, group: int = TOPK_GROUP):
    """Top-k positions of score rows `[B, S]` (−inf = not allowed) -> int32 `[B, topk]`, best first, −1 past the
    allowed keys. Same selection and tie rule as `lax.top_k` on the row (equal scores: the earlier position wins;
    +0.0 and −0.0 are equal), but in two stages when S is long (S / group > topk):
      1. m[g] = max of each group of `group` consecutive scores; keep the topk groups with the largest m (ties: the
         earlier group) — the k-th largest score overall is ≥ the k-th largest group max t, so every selected key
         lies in a group with max ≥ t, i.e. in a kept group or in a later group tied at t whose keys lose the
         earlier-position tie-break to the kept groups' keys;
      2. `lax.top_k` over the kept groups' topk·group scores, laid out in position order.
    So XLA sorts S/group + topk·group values instead of S (at S = 1M, k = 2048: 98K instead of 1M)."""
    s = jnp.where(s_bs == 0, 0.0, s_bs.astype(jnp.float32))
    B, S = s.shape
    if S < topk:
        s = jnp.pad(s, ((0, 0), (0, topk - S)), constant_values=-jnp.inf)
        S = topk
    if S % group or S // group <= topk:
        vals, idx = jax.lax.top_k(s, topk)
        return jnp.where(vals > -jnp.inf, idx, -1).astype(jnp.int32)
    sg = s.reshape(B, S // group, group)
    _, gid = jax.lax.top_k(jnp.max(sg, axis=-1), topk)  # [B, topk]
    gid = jnp.sort(gid, axis=-1)  # position order, so stage 2's lower-index tie rule = earlier position
    cand = jnp.take_along_axis(sg, gid[..., None], axis=1).reshape(B, topk * group)
    vals, j = jax.lax.top_k(cand, topk)
    pos = jnp.take_along_axis(gid, j // group, axis=1) * group + j % group
    return jnp.where(vals > -jnp.inf, pos, -1).astype(jnp.int32)


def _kernel_supports(kind: str, fmt, q_shape, key_parts=()) -> bool:
    B, T, Hi, d = q_shape
    if T != 1:
        return False
    if kind == "gpu":
        return gpu_triton.available() and gpu_triton.fits(fmt, Hi, d)
    return tpu.supports(fmt)


def kernel_scores(q_bhd, w_bh, key_parts, block_tables, pos_b, *, fmt, backend: str, **kernel_kw):
    """The decode score row `[B, max_blocks·page]` from a kernel backend ("gpu", "tpu", "*_interpret"; "triton" /
    "triton_interpret" name the GPU ones too)."""
    backend = canonical_dsa_backend(backend)
    if backend.startswith("gpu"):
        return gpu_triton.scores(q_bhd, w_bh, tuple(key_parts), block_tables, pos_b, fmt=fmt,
                                 interpret=backend == "gpu_interpret", **kernel_kw)
    return tpu.scores(q_bhd, w_bh, tuple(key_parts), block_tables, pos_b, fmt=fmt,
                      interpret=backend == "tpu_interpret", **kernel_kw)


def score_rows(q_bthd, w_bth, key_parts, block_tables, pos_bt, *, fmt, backend: str = "auto",
               platform: Optional[str] = None):
    """The index scores themselves, float32 `[B, T, max_blocks·page]` (−inf where not allowed: past the query's
    position, or every key of a padding query with pos < 0), for callers that merge selections themselves (decode
    context parallelism). One query per sequence (T = 1) takes the platform's score kernel under "auto" (or a named
    kernel), longer ones the reference; the ranking equals `topk_indices`' on the same backend."""
    T = q_bthd.shape[1]
    which = resolve_dsa_backend(backend, op="indexer", platform=platform,
                                supported=lambda kind: _kernel_supports(kind, fmt, q_bthd.shape, tuple(key_parts)))
    pos_bt = jnp.asarray(pos_bt, jnp.int32)
    if which != "reference" and T == 1:
        s = kernel_scores(q_bthd[:, 0], w_bth[:, 0], key_parts, block_tables, pos_bt[:, 0], fmt=fmt, backend=which)
        return s[:, None]
    keys_bsd = fmt.dequantize(gather_pages(tuple(key_parts), block_tables))
    allowed = jnp.arange(keys_bsd.shape[1], dtype=jnp.int32)[None, None, :] <= pos_bt[:, :, None]
    return reference.scores(q_bthd, keys_bsd, w_bth, allowed)


def topk_indices(q_bthd, w_bth, key_parts, block_tables, pos_bt, topk: int, *, fmt,
                 max_score_bytes: int = DEFAULT_MAX_SCORE_BYTES, backend: str = "auto", kernel_kw=None,
                 precision: str = "exact", platform: Optional[str] = None):
    """Top-k cached positions per query: q `[B, T, Hi, d]`, w `[B, T, Hi]` (scales folded in), pos `[B, T]` int
    (position of each query in its sequence; keys at positions ≤ pos are allowed). Returns int32 `[B, T, topk]`.
    Kernel backends are decode-only (T = 1); `kernel_kw` goes to the kernel (e.g. the GPU kernel's block_n).
    `precision`: "exact" (scores to ≈ fp32 against the dequantised keys) or "storage" (the GPU kernel's single-pass
    preset `gpu_triton.FAST[gpu_triton.storage_preset(tokens)]` for the tables' span: selections equal but for
    near-ties within 2× the score error; explicit kernel_kw still win; other backends unchanged). `platform`
    ("cpu" | "tpu" | "gpu" / "cuda"; None = the default backend's) is what "auto" picks the kernel for."""
    T = q_bthd.shape[1]
    check_precision(precision)
    which = resolve_dsa_backend(backend, op="indexer",
                                supported=lambda kind: _kernel_supports(kind, fmt, q_bthd.shape, tuple(key_parts)),
                                platform=platform)
    pos_bt = jnp.asarray(pos_bt, jnp.int32)
    if which != "reference":
        if T != 1:
            raise ValueError(f"the {which} indexer kernel is decode-only (T = 1), got T = {T}")
        kernel_kw = dict(kernel_kw or {})
        if precision == "storage" and which.startswith("gpu"):
            tokens = jnp.shape(block_tables)[1] * key_parts[0].shape[1]
            kernel_kw = dict(gpu_triton.FAST[gpu_triton.storage_preset(tokens)], **kernel_kw)
        s = kernel_scores(q_bthd[:, 0], w_bth[:, 0], key_parts, block_tables, pos_bt[:, 0], fmt=fmt, backend=which,
                          **kernel_kw)
        return select_topk(s, topk)[:, None]
    return _reference(q_bthd, w_bth, tuple(key_parts), block_tables, pos_bt, fmt=fmt,
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
