"""Speculative decoding (docs/model.md §12): a proposer drafts up to k tokens per running sequence, the target model
verifies all of them in one forward pass of shape ``[B, k+1]``, and an acceptance rule keeps the output distribution
exactly the target's.

How the engine runs it (``Engine._decode`` with ``EngineConfig.speculative_tokens = k``; the host side of
drafting in ``speculation.py``):

1. the proposer (``ngram.NgramProposer``: prompt lookup, no second model) drafts ``d_1..d_v`` (v ≤ k) for each
   eligible row from that row's own tokens; rows it cannot help, and rows that are not eligible, get v = 0;
2. ``ModelRunner.verify``: one forward over ``[last, d_1..d_k]`` per row (KDA layers deferred,
   ``modules.kda.KDAPending``), then ``verify_sample`` below, then ``commit_verify`` keeps each row's
   ``1 + accepted`` tokens in the cache (KDA replays its recurrence over them; MLA rows need only the length);
3. the host emits ``accepted + 1`` tokens per row through ``Engine._emit`` (``output.py``; stop strings, max_tokens,
   streams).

Acceptance for a deterministic proposer (its draft distribution q is one-hot): draft ``d_{i+1}`` is kept with
probability ``p_i(d_{i+1})``, where ``p_i`` is the target's processed distribution at position i (the same
processing as ``sampler.sample``: bias, constraints, min_tokens, temperature, top-k / top-p / min-p); at the first
rejection the emitted token is drawn from ``p_i`` with the rejected draft removed (``norm(max(0, p − q))`` for a
one-hot q); when every valid draft is kept a bonus token is drawn from ``p_v``.  With temperature 0 this is
exact-match acceptance against the argmax, so greedy output equals non-speculative greedy output.  A row with v = 0
draws exactly what ``sampler.sample`` would (same processing, same key), so speculation never changes a row it does
not draft for.  Keys: position i draws with the row's key for generated-token index ``gen_step + i``; the
acceptance coins come from a fold of the same key, so a seeded request's output does not depend on its batch.

A draft model that samples its drafts (``draft_sample_method`` probabilistic) hands its distributions q to the
verify program as well; those rows are kept with probability min(1, p/q) and resampled from norm(max(0, p − q)),
docs/model.md §12's rule (``verify_sample``'s ``q_bkv``).

Every row that emits a token this step may draft.  Penalties are applied per position with the counts the drafts
before it would have made; a guided row's constraint per position is its guide's state after the drafts before it
(the engine walks a copy of the guide), and what a guide forces is drafted outright -- certain to be kept, so a
forced run of tokens costs one verify step ("jump-forward").

``accept`` below is the general rule for proposers that carry a draft distribution q (a draft model).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, Sequence

import jax
import jax.numpy as jnp

from .sampler import Controls, Rows, Tables, process, row_keys, top_logprobs

COIN_STREAM = 0x5EC  # folded into a row's key for its acceptance coins (the draws use the key itself)


class DraftProposer(Protocol):
    """Drafts up to ``k`` next tokens of one sequence from its tokens so far (prompt + generated)."""

    k: int

    def propose(self, seq_id, tokens: Sequence[int], max_tokens: int) -> list[int]: ...

    def forget(self, seq_id) -> None: ...


class VerifyOut(NamedTuple):
    tokens: jax.Array  # i32 [B, k+1]: the tokens to emit, the first n[b] of them valid
    n: jax.Array  # i32 [B]: tokens emitted (accepted drafts + 1), in 1..v[b]+1
    logprob: jax.Array  # f32 [B, k+1]: raw log-probability of each emitted token at its position
    top_ids: jax.Array  # i32 [B, k+1, MAX_TOP_LOGPROBS]
    top_logprobs: jax.Array  # f32 [B, k+1, MAX_TOP_LOGPROBS]


def verify_sample(logits_bkv, drafts_bk, n_draft_b, rows: Rows, ctl: Controls, counts_bv, prompt_mask_bv,
                  tables: Tables, q_bkv=None, has_q_bk=None, plain: bool = False):
    """Acceptance of one verify pass, fused into the engine's verify program.

    logits ``[B, k+1, V]`` float32 at the positions of ``[last, d_1..d_k]``; drafts ``[B, k]`` int32; n_draft ``[B]``
    int32 (valid drafts per row, 0..k; the rest are padding).  ``ctl.gen_step`` is the index of the row's first
    token to generate; position i uses ``gen_step + i`` (min_tokens, keys) and the counts plus drafts
    ``d_1..d_i`` (penalties), exactly what the one-token step would see had those drafts been sampled.
    ``ctl.allow_class`` / ``ctl.allow_ids``: ``[B]`` / ``[B, M]`` for every position alike, or ``[B, k+1]`` /
    ``[B, k+1, M]`` per position (a guide's constraint after each draft).
    ``q_bkv`` float32 ``[B, k, V]`` and ``has_q_bk`` bool ``[B, k]`` (``draft_sample_method`` probabilistic): where
    ``has_q``, draft ``d_{i+1}`` was sampled from ``q[b, i]`` and is kept with probability min(1, p_i(d)/q_i(d)); at
    its rejection the emitted token is drawn from norm(max(0, p_i − q_i)).  Elsewhere (and when q is None) the draft
    counts as deterministic (one-hot q): the same bits as without q.  ``plain``: as in `sampler.sample`.
    Returns (VerifyOut, new counts -- the emitted tokens added on rows that emit).
    """
    B, K1, V = logits_bkv.shape
    K = K1 - 1
    pos = jnp.arange(K1, dtype=jnp.int32)
    drafts = drafts_bk.astype(jnp.int32)
    # the generated-token counts position i sees: the row's counts plus drafts d_1..d_i (penalties)
    valid_bk = pos[None, :K] < n_draft_b[:, None]
    drafted_bkv = jnp.cumsum(jax.nn.one_hot(drafts, V, dtype=counts_bv.dtype) * valid_bk[..., None], axis=1)
    counts_at = jnp.concatenate([jnp.zeros((B, 1, V), counts_bv.dtype), drafted_bkv], axis=1) + counts_bv[:, None]

    allow_class = ctl.allow_class if ctl.allow_class.ndim == 2 else jnp.repeat(ctl.allow_class[:, None], K1, 1)
    allow_ids = ctl.allow_ids if ctl.allow_ids.ndim == 3 else jnp.repeat(ctl.allow_ids[:, None], K1, 1)

    def at_position(logits_bv, counts_i, allow_class_i, allow_ids_i, i):
        c = ctl._replace(gen_step=ctl.gen_step + i, allow_class=allow_class_i, allow_ids=allow_ids_i)
        return process(logits_bv, rows, c, counts_i, prompt_mask_bv, tables, plain), row_keys(rows, c.gen_step)

    pr, keys = jax.vmap(at_position, in_axes=(1, 1, 1, 1, 0))(logits_bkv, counts_at, allow_class, allow_ids, pos)
    # p_i(d_{i+1}) for i < k
    d_kb = drafts.T
    p_draft = jnp.take_along_axis(jax.nn.softmax(pr.scaled[:K], axis=-1), d_kb[..., None], axis=-1)[..., 0]
    p_draft = jnp.where(pr.hot[:K], p_draft, (pr.greedy[:K] == d_kb).astype(jnp.float32))
    coins = jax.vmap(jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, COIN_STREAM), (), jnp.float32)))(
        keys[:K])
    if q_bkv is not None:  # u < p/q without dividing; q(d) > 0 for a draft sampled from q
        q_draft = jnp.take_along_axis(q_bkv, drafts[..., None], axis=-1)[..., 0].T  # [K, B]
        coins = coins * jnp.where(has_q_bk.T, q_draft, 1.0)
    ok_kb = (coins < p_draft) & (pos[:K, None] < n_draft_b[None, :])
    n_acc = jnp.sum(jnp.cumprod(ok_kb.astype(jnp.int32), axis=0), axis=0)  # [B]: kept before the first rejection

    # the token at position n_acc: from p_{n_acc}, without the rejected draft when there was a rejection
    take = lambda a: jnp.take_along_axis(a, n_acc.reshape((1, B) + (1,) * (a.ndim - 2)), axis=0)[0]
    scaled, greedy, hot, key = take(pr.scaled), take(pr.greedy), pr.hot[0], take(keys)
    padded = jnp.concatenate([drafts, jnp.zeros((B, 1), jnp.int32)], axis=1)  # [B, k+1]
    rejected = n_acc < n_draft_b
    d_rej = jnp.take_along_axis(padded, n_acc[:, None], axis=1)[:, 0]  # the draft rejected at n_acc
    one_hot_rest = jnp.where(rejected[:, None] & (jnp.arange(V)[None, :] == d_rej[:, None]), -jnp.inf, scaled)
    if q_bkv is not None:
        # a rejected draft sampled from q: the residual norm(max(0, p − q)), as log-weights for the Gumbel draw
        at = jnp.minimum(n_acc, K - 1)
        q_at = jnp.take_along_axis(q_bkv, at[:, None, None], axis=1)[:, 0]  # [B, V]
        sampled = rejected & jnp.take_along_axis(has_q_bk, at[:, None], axis=1)[:, 0]
        resid = jnp.maximum(jax.nn.softmax(scaled, axis=-1) - q_at, 0.0)
        log_resid = jnp.where(resid > 0, jnp.log(jnp.where(resid > 0, resid, 1.0)), -jnp.inf)
        # p = q to the last bit leaves no residual (then no rejection could have happened): fall back to p
        sampled = sampled & jnp.any(resid > 0, axis=-1)
        scaled = jnp.where(sampled[:, None], log_resid, one_hot_rest)
    else:
        scaled = one_hot_rest
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (V,), jnp.float32))(key)
    extra = jnp.where(hot, jnp.argmax(scaled + gumbel, axis=-1).astype(jnp.int32), greedy)

    tokens = jnp.where(pos[None] < n_acc[:, None], padded, jnp.where(pos[None] == n_acc[:, None], extra[:, None], 0))
    raw_lp = jnp.swapaxes(pr.raw_lp, 0, 1)  # [B, k+1, V]
    logprob = jnp.take_along_axis(raw_lp, tokens[..., None], axis=-1)[..., 0]
    top_ids, top_lp = top_logprobs(raw_lp.reshape(B * K1, V), rows.top_logprobs, plain)
    n = n_acc + 1
    add = (pos[None] < n[:, None]) & ctl.emit[:, None]
    counts = counts_bv.at[jnp.arange(B)[:, None], tokens].add(add.astype(counts_bv.dtype))
    return VerifyOut(tokens, n.astype(jnp.int32), logprob, top_ids.reshape(B, K1, -1),
                     top_lp.reshape(B, K1, -1)), counts


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
