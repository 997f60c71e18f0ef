"""Speculative decoding: the seam and its acceptance rule (SPEC §12).  Not wired into the engine loop yet.

How it plugs in (``Engine._decode`` is the one place that advances running sequences):

    drafts, q = proposer.propose(rows)                       # [B, k] draft tokens and the draft distributions q
    logits = verify_step(params, state, [last, drafts])      # one target forward of shape [B, k+1] (T > 1 against
                                                             # per-row cache lengths works in the modules today)
    p = softmax(processed logits)                            # the same per-row processing as sampler.sample
    tokens, n = accept(p, q, drafts, key)                    # n[b] in 1..k+1 tokens to emit for row b
    roll the cache back to length + n (MLA: set ``length``; KDA: keep the state after token n -- needs the verify
    pass to return per-position KDA states, the missing piece) and call ``Engine._emit`` for each emitted token.

``DraftProposer`` is the interface a draft model (or DSpark / n-gram lookup) implements.  ``accept`` is the
rejection-sampling rule that makes the output distribution exactly the target's: draft token i is kept with
probability ``min(1, p_i(x_i) / q_i(x_i))``; at the first rejection a token is drawn from ``norm(max(0, p_i - q_i))``
and the rest is dropped; when every draft is kept a bonus token is drawn from ``p_{k+1}``.  With greedy (one-hot)
``p`` and ``q`` it reduces to exact-match acceptance.
"""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp


class DraftProposer(Protocol):
    """Proposes ``k`` tokens per running row.  Returns (draft tokens int ``[B, k]``, draft probabilities ``[B, k, V]``
    from which they were sampled -- one-hot for greedy drafting)."""

    k: int

    def propose(self, rows) -> tuple[jax.Array, jax.Array]: ...


def accept(p_bkv: jax.Array, q_bkv: jax.Array, draft_bk: jax.Array, key: jax.Array):
    """Rejection-sampling acceptance.

    p_bkv: target probabilities ``[B, k+1, V]`` at the k draft positions and the bonus position;
    q_bkv: draft probabilities ``[B, k, V]``; draft_bk: the drafts ``[B, k]``.
    Returns (tokens ``[B, k+1]`` int32 -- the first ``n[b]`` are valid --, n ``[B]`` int32 in ``1..k+1``).
    """
    B, K1, V = p_bkv.shape
    K = K1 - 1
    k_u, k_r = jax.random.split(key)
    draft = draft_bk.astype(jnp.int32)
    px = jnp.take_along_axis(p_bkv[:, :K], draft[..., None], axis=-1)[..., 0]
    qx = jnp.take_along_axis(q_bkv, draft[..., None], axis=-1)[..., 0]
    u = jax.random.uniform(k_u, (B, K), jnp.float32)
    ok = u * qx < px  # u < p/q without dividing (qx > 0 for a sampled draft)
    n_acc = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)  # drafts kept before the first rejection
    p_at = jnp.take_along_axis(p_bkv, n_acc[:, None, None], axis=1)[:, 0]  # [B, V]
    q_at = jnp.take_along_axis(q_bkv, jnp.minimum(n_acc, K - 1)[:, None, None], axis=1)[:, 0]
    q_at = jnp.where((n_acc < K)[:, None], q_at, 0.0)  # all kept: the bonus comes from p_{k+1} itself
    resid = jnp.maximum(p_at - q_at, 0.0)
    total = jnp.sum(resid, axis=-1, keepdims=True)
    resid = jnp.where(total > 0, resid / jnp.where(total > 0, total, 1.0), p_at)
    extra = jax.random.categorical(k_r, jnp.log(jnp.maximum(resid, 1e-38)), axis=-1).astype(jnp.int32)
    pos = jnp.arange(K1)[None, :]
    padded = jnp.concatenate([draft, jnp.zeros((B, 1), jnp.int32)], axis=1)
    tokens = jnp.where(pos < n_acc[:, None], padded, jnp.where(pos == n_acc[:, None], extra[:, None], 0))
    return tokens, (n_acc + 1).astype(jnp.int32)
