"""A draft model for speculative decoding (SPEC §12): a second, smaller kimi_jax ``Model`` over the same vocabulary
proposes the next tokens of each sequence, and the target verifies them in its one verify step (``spec_decode``).

Two ways to draft (``draft_sample_method``, ``DRAFT_SAMPLE_METHODS``):
- ``greedy`` (default): the draft model's argmax. Its distribution q is one-hot, and SPEC §12's acceptance
  min(1, p/q) becomes the engine's rule for deterministic proposers: keep draft d with probability p(d), and at the
  first rejection draw from p without d.
- ``probabilistic``: for a row that samples (temperature T > 0) each draft is drawn from q = softmax(draft logits / T)
  with the row's own key (``draft_keys``: the request's seed and the token's index, on a stream of its own), and q
  is kept on the device for the verify program, which keeps draft d with probability min(1, p(d)/q(d)) and at a
  rejection draws from norm(max(0, p − q)). A greedy row (T = 0) drafts greedily in either mode.
Either way the output distribution is the target's exactly, and at temperature 0 the output equals decoding
without speculation, whatever the draft model. The engine keeps a sampled row's number of drafts independent of
their values (a choice that looked at them would bias the output); a guided row drafts greedily.

Per sequence the proposer keeps the draft model's cache over the tokens known to be in the sequence (prompt and
emitted output) and what the draft program returned after them (its argmax, or its logits when sampling). A
proposal first feeds what the sequence gained since the last one (the accepted drafts and the verify step's own
token) in chunks of fixed sizes (``FEED_CHUNKS``: a few compiled programs whatever the lengths). It then runs
single-token steps on that cache without donating it: JAX arrays are immutable, so the kept cache still holds only
the known tokens, and a rejected draft never needs rolling back (a KDA layer's state could not be un-updated). A
context that is not the old one plus new tokens (another request under the same id, a preempted sequence
recomputed) starts over.

A proposal keeps the caches it explored (the cache over the known tokens and the first i drafts, i < k). The next
proposal resumes from the one that holds the drafts the target kept, so it feeds only the verify step's own token
(two tokens when every draft was kept) instead of everything the sequence gained.

Cost: one compiled program per feed chunk size, each call one sequence; a step's proposal is one or two feed calls
plus k − 1 draft steps (and k small draw programs when sampling), dispatched from the engine thread, with one
device-to-host transfer for the k drafts. Memory: a sequence holds up to k copies of the draft model's cache
between two proposals (the caches are not donated), and a sampling row its ``[k, V]`` float32 q.
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

DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")  # SPEC §12's draft_sample_method
_WARMUP = object()  # the dummy sequence id warmup() proposes for
DRAFT_STREAM = 0xD4A  # folded into a row's key for its drafts (the verify step draws with the key and COIN_STREAM)


@functools.lru_cache(maxsize=8)
def _advance_program(model, logits_out: bool = False):
    """`(params, ids [1, T], cache) -> (after, cache)` for one draft `Model`, jitted once per model and output
    (proposers over the same model share its compiled programs); `after` is the argmax after the last id (int32
    scalar) or, with `logits_out`, its logits (float32 `[V]`). No donation: the kept cache is read again by the
    next proposal."""
    graphdef = model.graphdef

    def advance(params, ids_bt, cache):
        logits, cache = nnx.merge(graphdef, params)(ids_bt, cache)
        last_v = logits[0, -1].astype(jnp.float32)
        return (last_v if logits_out else jnp.argmax(last_v).astype(jnp.int32)), cache

    return jax.jit(advance)


def draft_keys(seed, choice, gen_step):
    """The PRNG key a sampled draft for generated-token index ``gen_step`` is drawn with: the engine's row key for
    that index (``sampler.row_keys``: request seed, choice) folded with ``DRAFT_STREAM``, so the drafts are
    independent of the verify step's coins and draws, and a seeded request drafts the same tokens in any batch."""
    row = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed), choice), gen_step)
    return jax.random.fold_in(row, DRAFT_STREAM)


@jax.jit
def _draw(logits_v, temperature, seed, choice, gen_step):
    """One draft from float32 logits ``[V]``: a Gumbel-max draw from q = softmax(logits / T) with ``draft_keys``.
    Returns (token int32 scalar, q float32 ``[V]``)."""
    scaled_v = logits_v / temperature
    gumbel_v = jax.random.gumbel(draft_keys(seed, choice, gen_step), scaled_v.shape, jnp.float32)
    return jnp.argmax(scaled_v + gumbel_v).astype(jnp.int32), jax.nn.softmax(scaled_v)


@dataclass
class _DraftState:
    known: list  # the tokens the cache holds, in order
    cache: Any  # the draft model's contiguous cache over `known` (never donated)
    after: Any  # on the device, what the draft program returned after `known`: its argmax, or its logits `[V]`
    # the last proposal, so that the next one resumes after the drafts the target kept: its drafts d_1..d_n as ids,
    # explored[i] = the cache over known + d_1..d_i (explored[0] is `cache`) and afters[i] what the program
    # returned after explored[i] (greedy: d_{i+1} itself); q: the drafts' distributions `[k, V]` when sampled
    draft_ids: list = field(default_factory=list)
    afters: list = field(default_factory=list)
    explored: list = field(default_factory=list)
    q: Any = None


class DraftModelProposer:
    """Drafts up to ``k`` tokens per sequence with the draft model's continuation (``DraftProposer``): greedy, or
    sampled with its distributions kept (``sample_method="probabilistic"``)."""

    def __init__(self, draft_model, k: int, max_len: int, *, vocab_size: int | None = None,
                 sample_method: str = "greedy"):
        """``draft_model``: a ``kimi_jax.model.Model``; ``max_len``: the longest context it must hold (the engine's
        max_model_len plus k); ``vocab_size``: the target's, which the draft's must equal (the same token ids);
        ``sample_method``: one of ``DRAFT_SAMPLE_METHODS``."""
        if k < 1:
            raise ValueError(f"speculative tokens must be >= 1, got {k}")
        if sample_method not in DRAFT_SAMPLE_METHODS:
            raise ValueError(f"unknown draft sample method {sample_method!r}; choose from "
                             f"{', '.join(DRAFT_SAMPLE_METHODS)}")
        dcfg = draft_model.config
        if vocab_size is not None and dcfg.vocab_size != vocab_size:
            raise ValueError(f"the draft model's vocabulary ({dcfg.vocab_size} ids) is not the target's "
                             f"({vocab_size}): a draft model must share the target's tokenizer")
        if max_len > dcfg.max_position_embeddings:
            raise ValueError(f"the draft model holds {dcfg.max_position_embeddings} positions, fewer than the "
                             f"{max_len} this engine needs (max_model_len + speculative tokens)")
        self.k, self.max_len = int(k), int(max_len)
        self.model = draft_model
        self.sample_method = sample_method
        self.samples = sample_method == "probabilistic"  # the verify program then takes the drafts' q
        self._seqs: dict = {}
        self._advance = _advance_program(draft_model, self.samples)

    def warmup(self) -> None:
        """Compile every feed program now (the engine calls this at start, so serving compiles nothing)."""
        cache = self.model.new_cache(1, self.max_len)
        for n in FEED_CHUNKS:
            if n <= self.max_len:
                jax.block_until_ready(self._advance(self.model.params, np.zeros((1, n), np.int32), cache))
        # one sampled and one greedy proposal on a dummy sequence: the small programs around the draft steps
        # (draws, argmax, reshapes, q's padding) compile here too
        for temperature in ((1.0, 0.0) if self.samples else (0.0,)):
            self.propose(_WARMUP, [0], self.k, temperature=temperature)
            self.forget(_WARMUP)

    def propose(self, seq_id, tokens: Sequence[int], max_tokens: int, *, temperature: float = 0.0,
                seed: int = 0, choice: int = 0, gen_step: int = 0) -> list[int]:
        """Up to ``min(k, max_tokens)`` drafts following ``tokens`` (the sequence's whole context).

        Sampling (``probabilistic`` and ``temperature`` > 0): draft i is drawn with ``draft_keys(seed, choice,
        gen_step + i)`` (``seed``: the row's 32-bit sampling seed; ``gen_step``: the index of the token the first
        draft stands for), and ``q(seq_id)`` then holds the distributions. Otherwise the drafts are greedy."""
        limit = min(self.k, int(max_tokens))
        if limit < 1 or len(tokens) == 0:
            return []
        if len(tokens) + limit > self.max_len:
            return []
        state = self._state_for(seq_id, tokens)
        after, cache = state.after, state.cache
        afters, explored, drafts, qs = [], [], [], []
        sample = self.samples and temperature > 0
        for i in range(limit):
            afters.append(after)
            explored.append(cache)
            if not self.samples:
                tok = after
            elif sample:
                tok, q = _draw(after, np.float32(temperature), np.uint32(seed), np.int32(choice),
                               np.int32(gen_step + i))
                qs.append(q)
            else:
                tok = jnp.argmax(after).astype(jnp.int32)
            drafts.append(tok)
            if i < limit - 1:
                after, cache = self._advance(self.model.params, tok.reshape(1, 1), cache)
        state.draft_ids = [int(t) for t in jax.device_get(drafts)]
        state.afters, state.explored = afters, explored
        state.q = self._pad_q(qs) if qs else None
        return list(state.draft_ids)

    def q(self, seq_id):
        """The distributions the last proposal for ``seq_id`` sampled its drafts from: float32 ``[k, V]`` on the
        device (row i for draft i + 1; rows past the drafts are zero), or None when it drafted greedily."""
        state = self._seqs.get(seq_id)
        return None if state is None else state.q

    def _pad_q(self, qs):
        return jnp.stack(list(qs) + [jnp.zeros_like(qs[0])] * (self.k - len(qs)))

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
        cache, at = state.cache, 0
        if state.explored:
            # the kept drafts d_1..d_j (the sequence's new tokens start with them) are in explored[j] already; with
            # every draft kept, d_n is not in any explored cache: resume from explored[n − 1] and feed it
            while at < min(len(state.explored) - 1, len(new)) and state.draft_ids[at] == new[at]:
                at += 1
            cache, after = state.explored[at], state.afters[at]
        else:
            after = state.after
        while at < len(new):
            n = next(c for c in FEED_CHUNKS if c <= len(new) - at)
            after, cache = self._advance(self.model.params, np.asarray([new[at:at + n]], np.int32), cache)
            at += n
        state = _DraftState(state.known + new, cache, after)
        self._seqs[seq_id] = state
        return state
