"""A draft model for speculative decoding (SPEC §12): a second, smaller kimi_jax ``Model`` over the same vocabulary
proposes the next tokens of each sequence, and the target verifies them in its one verify step (``spec_decode``).

Drafts are the draft model's argmax (``draft_sample_method`` greedy). Its distribution q is then one-hot, and SPEC
§12's acceptance min(1, p/q) becomes the engine's rule for deterministic proposers: keep draft d with probability
p(d), and at the first rejection draw from p without d. So the output distribution is the target's exactly, and at
temperature 0 the output equals decoding without speculation, whatever the draft model. (Sampled drafts that keep q,
``probabilistic``, would need q inside the verify program; that is not built.)

Per sequence the proposer keeps the draft model's cache over the tokens known to be in the sequence (prompt and
emitted output) and the draft's argmax after them. A proposal first feeds what the sequence gained since the last
one (the accepted drafts and the verify step's own token) in chunks of fixed sizes (``FEED_CHUNKS``: a few compiled
programs whatever the lengths). It then runs single-token steps on that cache without donating it: JAX arrays are
immutable, so the kept cache still holds only the known tokens, and a rejected draft never needs rolling back (a KDA
layer's state could not be un-updated). A context that is not the old one plus new tokens (another request under
the same id, a preempted sequence recomputed) starts over.

A proposal keeps the caches it explored (the cache over the known tokens and the first i drafts, i < k). The next
proposal resumes from the one that holds the drafts the target kept, so it feeds only the verify step's own token
(two tokens when every draft was kept) instead of everything the sequence gained.

Cost: one compiled program per feed chunk size, each call one sequence; a step's proposal is one or two feed calls
plus k − 1 draft steps, dispatched from the engine thread, with one device-to-host transfer for the k drafts. Memory:
a sequence holds up to k copies of the draft model's cache between two proposals (the caches are not donated).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

# the chunk sizes a sequence's new tokens are fed in, largest first (one compiled program each; the engine's default
# prefill chunks too). A prompt goes in 64-token chunks; what a sequence gains per step (≤ k + 1 tokens) token by token
FEED_CHUNKS = (64, 1)


@functools.lru_cache(maxsize=4)
def _advance_program(model):
    """`(params, ids [1, T], cache) -> (the argmax after the last id, cache)` for one draft `Model`, jitted once per
    model (proposers over the same model share its compiled programs). No donation: the kept cache is read again
    by the next proposal."""
    graphdef = model.graphdef

    def advance(params, ids_bt, cache):
        logits, cache = nnx.merge(graphdef, params)(ids_bt, cache)
        return jnp.argmax(logits[0, -1]).astype(jnp.int32), cache

    return jax.jit(advance)


@dataclass
class _DraftState:
    known: list  # the tokens the cache holds, in order
    cache: Any  # the draft model's contiguous cache over `known` (never donated)
    next_token: Any  # int32 scalar on the device: the draft's argmax after `known`
    # the last proposal, so that the next one resumes after the drafts the target kept: its drafts d_1..d_n as ids
    # and as device scalars, and explored[i] = the cache over known + d_1..d_i (explored[0] is `cache`; drafts[i],
    # d_{i+1}, is the argmax after explored[i])
    draft_ids: list = field(default_factory=list)
    drafts: list = field(default_factory=list)
    explored: list = field(default_factory=list)


class DraftModelProposer:
    """Drafts up to ``k`` tokens per sequence with the draft model's greedy continuation (``DraftProposer``)."""

    def __init__(self, draft_model, k: int, max_len: int, *, vocab_size: int | None = None):
        """``draft_model``: a ``kimi_jax.model.Model``; ``max_len``: the longest context it must hold (the engine's
        max_model_len plus k); ``vocab_size``: the target's, which the draft's must equal (the same token ids)."""
        if k < 1:
            raise ValueError(f"speculative tokens must be >= 1, got {k}")
        dcfg = draft_model.config
        if vocab_size is not None and dcfg.vocab_size != vocab_size:
            raise ValueError(f"the draft model's vocabulary ({dcfg.vocab_size} ids) is not the target's "
                             f"({vocab_size}): a draft model must share the target's tokenizer")
        if max_len > dcfg.max_position_embeddings:
            raise ValueError(f"the draft model holds {dcfg.max_position_embeddings} positions, fewer than the "
                             f"{max_len} this engine needs (max_model_len + speculative tokens)")
        self.k, self.max_len = int(k), int(max_len)
        self.model = draft_model
        self._seqs: dict = {}
        self._advance = _advance_program(draft_model)

    def warmup(self) -> None:
        """Compile every feed program now (the engine calls this at start, so serving compiles nothing)."""
        cache = self.model.new_cache(1, self.max_len)
        for n in FEED_CHUNKS:
            if n <= self.max_len:
                jax.block_until_ready(self._advance(self.model.params, jnp.zeros((1, n), jnp.int32), cache))

    def propose(self, seq_id, tokens: Sequence[int], max_tokens: int) -> list[int]:
        """Up to ``min(k, max_tokens)`` drafts following ``tokens`` (the sequence's whole context)."""
        limit = min(self.k, int(max_tokens))
        if limit < 1 or len(tokens) == 0:
            return []
        if len(tokens) + limit > self.max_len:
            return []
        state = self._state_for(seq_id, tokens)
        drafts, explored = [state.next_token], [state.cache]
        tok, cache = state.next_token, state.cache
        for _ in range(limit - 1):
            tok, cache = self._advance(self.model.params, tok.reshape(1, 1), cache)
            drafts.append(tok)
            explored.append(cache)
        state.draft_ids = [int(t) for t in jax.device_get(drafts)]
        state.drafts, state.explored = drafts, explored
        return list(state.draft_ids)

    def forget(self, seq_id) -> None:
        """Drop a finished (or preempted) sequence's cache."""
        self._seqs.pop(seq_id, None)

    def _state_for(self, seq_id, tokens: Sequence[int]) -> _DraftState:
        state = self._seqs.get(seq_id)
        L = len(tokens)
        n_known = len(state.known) if state is not None else 0
        if state is None or L < n_known or (n_known and list(tokens[:n_known]) != state.known):
            state = _DraftState([], self.model.new_cache(1, self.max_len), None)
        new = [int(t) for t in tokens[len(state.known):]]
        cache, tok, at = state.cache, state.next_token, 0
        if state.explored:
            # the kept drafts d_1..d_j (the sequence's new tokens start with them) are in explored[j] already; with
            # every draft kept, d_n is not in any explored cache: resume from explored[n − 1] and feed it
            while at < min(len(state.explored) - 1, len(new)) and state.draft_ids[at] == new[at]:
                at += 1
            cache, tok = state.explored[at], state.drafts[at]
        while at < len(new):
            n = next(c for c in FEED_CHUNKS if c <= len(new) - at)
            tok, cache = self._advance(self.model.params, jnp.asarray([new[at:at + n]], jnp.int32), cache)
            at += n
        state = _DraftState(state.known + new, cache, tok)
        self._seqs[seq_id] = state
        return state
