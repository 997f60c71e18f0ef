"""A draft model for speculative decoding (docs/model.md §12): a second, smaller kimi_jax ``Model`` over the same
vocabulary proposes the next tokens of each sequence, and the target verifies them in its one verify step
(``spec_decode``).

Two ways to draft (``draft_sample_method``, ``DRAFT_SAMPLE_METHODS``):
- ``greedy`` (default): the draft model's argmax. Its distribution q is one-hot, and docs/model.md §12's acceptance
  min(1, p/q) becomes the engine's rule for deterministic proposers: keep draft d with probability p(d), and at the
  first rejection draw from p without d.
- ``probabilistic``: for a row that samples (temperature T > 0) each draft is drawn from q = softmax(draft logits / T)
  with the row's own key (``draft_keys``: the request's seed and the token's index, on a stream of its own), and q
  is kept on the device for the verify program, which keeps draft d with probability min(1, p(d)/q(d)) and at a
  rejection draws from norm(max(0, p − q)). A greedy row (T = 0) drafts greedily in either mode.
Either way the output distribution is the target's exactly, and at temperature 0 the output equals decoding
without speculation, whatever the draft model. The engine keeps a sampled row's number of drafts independent of
their values (a choice that looked at them would bias the output); a guided row drafts greedily.

The engine proposes for all its rows at once (``propose_batch``, row = slot): the draft steps run batched, one
program call per step for every sequence. Drafting never donates a cache: JAX arrays are immutable, so a cache
over known tokens stays valid after drafts were explored on it, and a rejected draft never needs rolling back (a
KDA layer's state could not be un-updated).

A proposal keeps the caches it explored: explored[i] holds, in each row, the cache over that row's context and its
first i drafts (i < k). The next proposal of a sequence resumes from the one that holds the drafts the target kept
(a copy of its row), feeds the rest but the last token one row at a time (usually nothing; all of a new prompt, in
chunks of fixed sizes, ``FEED_CHUNKS``), and then feeds every row's last token in one batched step. A context
that does not extend the last one (another request under the same id, a preempted sequence recomputed) starts
over.

Cost per engine step: one batched step for the rows' last tokens plus k − 1 batched draft steps (and k batched
draws when sampling), a row copy per resumed sequence, one stack of the rows, and one device-to-host transfer for
the drafts, all dispatched from the engine thread. On a 2-core CPU (tiny model, k = 4; ``bench/draft_batch.py``) a proposal
for 4 sequences takes 7.6 ms batched against 20.5 ms one sequence at a time. Memory: up to k batched copies of the draft model's cache between two proposals (not
donated), and when sampling a ``[rows, k, V]`` float32 q.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .param_leaves import ParamLeaves

# the chunk sizes a sequence's new tokens are fed in, largest first (one compiled program each; the engine's default
# prefill chunks too). A prompt goes in 64-token chunks; what a sequence gains per step (≤ k + 1 tokens) token by token
FEED_CHUNKS = (64, 1)

DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")  # docs/model.md §12's draft_sample_method
_WARMUP = object()  # the dummy sequence id warmup() proposes for
DRAFT_STREAM = 0xD4A  # folded into a row's key for its drafts (the verify step draws with the key and COIN_STREAM)


@functools.lru_cache(maxsize=8)
def _advance_program(model, logits_out: bool = False):
    """`(ids [B, T], cache) -> (after, cache)` for one draft `Model`, jitted once per model and output (proposers
    over the same model share its compiled programs), its parameters passed as a flat list (`ParamLeaves`); `after`
    is each row's argmax after its last id (int32 `[B]`) or, with `logits_out`, its logits (float32 `[B, V]`). No
    donation: the kept cache is read again by the next proposal."""
    graphdef, ctx = model.graphdef, model.ctx
    flat_params = ParamLeaves(model.params)

    def advance(params, ids_bt, cache):
        logits, cache = nnx.merge(graphdef, params)(ids_bt, cache, ctx=ctx)
        last_bv = logits[:, -1].astype(jnp.float32)
        return (last_bv if logits_out else jnp.argmax(last_bv, axis=-1).astype(jnp.int32)), cache

    jitted = jax.jit(flat_params.taking(advance))
    return lambda ids_bt, cache: jitted(flat_params.leaves, ids_bt, cache)


def draft_keys(seed, choice, gen_step):
    """The PRNG key a sampled draft for generated-token index ``gen_step`` is drawn with: the engine's row key for
    that index (``sampler.row_keys``: request seed, choice) folded with ``DRAFT_STREAM``, so the drafts are
    independent of the verify step's coins and draws, and a seeded request drafts the same tokens in any batch."""
    row = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed), choice), gen_step)
    return jax.random.fold_in(row, DRAFT_STREAM)


@jax.jit
def _draw_rows(logits_bv, temperature_b, seed_b, choice_b, gen_step_b):
    """One draft per row from float32 logits ``[B, V]``: where ``temperature`` > 0 a Gumbel-max draw from
    q = softmax(logits / T) with ``draft_keys``, else the argmax. Returns (tokens int32 ``[B]``, q float32
    ``[B, V]``; a greedy row's q is its softmax at T = 1 and is not used)."""

    def one(logits_v, temperature, seed, choice, gen_step):
        hot = temperature > 0
        scaled_v = logits_v / jnp.where(hot, temperature, 1.0)
        gumbel_v = jax.random.gumbel(draft_keys(seed, choice, gen_step), scaled_v.shape, jnp.float32)
        token = jnp.where(hot, jnp.argmax(scaled_v + gumbel_v), jnp.argmax(logits_v)).astype(jnp.int32)
        return token, jax.nn.softmax(scaled_v)

    return jax.vmap(one)(logits_bv, temperature_b, seed_b, choice_b, gen_step_b)


@jax.jit
def _stack_rows(caches):
    """Batch-1 caches -> one cache with a row each (the batched draft steps' input)."""
    return jax.tree.map(lambda *rows: jnp.concatenate(rows, axis=0), *caches)


@jax.jit
def _take_row(cache, row):
    """Row ``row`` of a batched cache as a batch-1 cache."""
    return cache.take(row)


@jax.jit
def _q_rows(qs):
    """k arrays ``[B, V]`` (draft i's q of every row) -> ``[B, k, V]``."""
    return jnp.stack(qs, axis=1)


@functools.partial(jax.jit, static_argnums=2)
def _q_by_request(q_bkv, slot_of_row_b, rows: int):
    """A packed batch's q ``[B, k, V]`` -> ``[rows, k, V]`` at each batch row's request row (padding rows, whose
    index is out of range, are dropped; rows without a request hold zeros)."""
    out = jnp.zeros((rows,) + q_bkv.shape[1:], q_bkv.dtype)
    return out.at[slot_of_row_b].set(q_bkv, mode="drop")


@dataclass(frozen=True)
class DraftRequest:
    """One row of a batched proposal (``DraftModelProposer.propose_batch``): the sequence, its whole context, the
    room left, and for a sampled draft its temperature, 32-bit seed, choice and the index of the token the first
    draft stands for (``draft_keys``)."""

    seq_id: Any
    tokens: Sequence[int]
    max_tokens: int
    temperature: float = 0.0
    seed: int = 0
    choice: int = 0
    gen_step: int = 0


@dataclass
class _DraftState:
    known: list  # the context of the sequence's last proposal
    # that proposal's caches: explored[i] (batched) holds at row `row` the cache over known + d_1..d_i
    explored: list
    row: int
    draft_ids: list  # d_1..d_n
    sampled: bool  # drawn from q (batch row `row` of the proposer's last packed q)


class DraftModelProposer:
    """Drafts up to ``k`` tokens per sequence with the draft model's continuation (``DraftProposer``): greedy, or
    sampled with its distributions kept (``sample_method="probabilistic"``); up to ``rows`` sequences per batched
    proposal (``propose_batch``)."""

    def __init__(self, draft_model, k: int, max_len: int, *, vocab_size: int | None = None,
                 sample_method: str = "greedy", rows: int = 1):
        """``draft_model``: a ``kimi_jax.model.Model``; ``max_len``: the longest context it must hold (the engine's
        max_model_len plus k); ``vocab_size``: the target's, which the draft's must equal (the same token ids);
        ``sample_method``: one of ``DRAFT_SAMPLE_METHODS``; ``rows``: the batch of the draft steps (the engine's
        slots: row = slot)."""
        if k < 1:
            raise ValueError(f"speculative tokens must be >= 1, got {k}")
        if rows < 1:
            raise ValueError(f"a draft batch needs at least one row, got {rows}")
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
        self.k, self.max_len, self.rows = int(k), int(max_len), int(rows)
        self.model = draft_model
        self.sample_method = sample_method
        self.samples = sample_method == "probabilistic"  # the verify program then takes the drafts' q
        self._seqs: dict = {}
        self._advance = _advance_program(draft_model, self.samples)
        self._zero1 = None  # an empty batch-1 cache: a new sequence's start, and a batch's padding rows
        # the batches the draft steps run in: powers of two up to `rows` (and `rows` itself)
        self.batch_sizes = tuple(sorted({min(1 << i, self.rows) for i in range(self.rows.bit_length() + 1)}))
        self._q = None  # [rows, k, V] float32: the last proposal's q by request row (sampled rows), on the device
        self._q_packed = None  # the same by batch row

    def warmup(self) -> None:
        """Compile every program now (the engine calls this at start, so serving compiles nothing): the feed
        chunks, and two proposals over every row (new sequences, then resumed ones) for the batched steps, the
        draws, the row copies and q."""
        cache = self._empty()
        for n in FEED_CHUNKS:
            if n <= self.max_len:
                jax.block_until_ready(self._advance(np.zeros((1, n), np.int32), cache))
        t = 1.0 if self.samples else 0.0
        for n in self.batch_sizes:
            ids = [(_WARMUP, r) for r in range(n)]
            drafts = self.propose_batch([DraftRequest(i, [0, 0], self.k, temperature=t) for i in ids])
            self.propose_batch([DraftRequest(i, [0, 0] + d[:1] + [0], self.k, temperature=t)
                                for i, d in zip(ids, drafts)])
            jax.block_until_ready(self._q)
            for i in ids:
                self.forget(i)

    def propose(self, seq_id, tokens: Sequence[int], max_tokens: int, *, temperature: float = 0.0,
                seed: int = 0, choice: int = 0, gen_step: int = 0) -> list[int]:
        """Up to ``min(k, max_tokens)`` drafts following ``tokens`` (the sequence's whole context): a proposal of
        one row (``propose_batch``)."""
        return self.propose_batch([DraftRequest(seq_id, tokens, max_tokens, temperature, seed, choice,
                                                gen_step)])[0]

    def propose_batch(self, requests: Sequence[Optional[DraftRequest]]) -> list[list[int]]:
        """Drafts for up to ``rows`` sequences at once: ``requests[r]`` is row r (None: no sequence). Each row gets
        up to ``min(k, max_tokens)`` drafts; none when that is < 1 or the context would outgrow the cache.

        The drafting rows run packed into a batch of the next power of two (``batch_sizes``): padding rows are not
        free (in an MoE draft model every row reads its experts). Per row, the cache over its context minus the
        last token comes from the last proposal's explored caches (plus, one row at a time, any tokens they lack: a
        new prompt, or steps the engine did not verify); then one batched step feeds every row's last token and
        ``max(limits) − 1`` batched steps draft. Sampling (``probabilistic`` and ``temperature`` > 0): draft i is
        drawn with ``draft_keys(seed, choice, gen_step + i)``, and ``q(seq_id)`` / ``batch_q()`` hold the
        distributions. Otherwise the drafts are greedy."""
        if len(requests) > self.rows:
            raise ValueError(f"{len(requests)} sequences in one proposal, but this proposer batches {self.rows}")
        limits = {}
        for r, req in enumerate(requests):
            if req is None:
                continue
            limit = min(self.k, int(req.max_tokens))
            if limit >= 1 and len(req.tokens) and len(req.tokens) + limit <= self.max_len:
                limits[r] = limit
        if not limits:
            self._q = None
            return [[] for _ in requests]
        live = list(limits)  # packed: batch row i drafts for requests[live[i]]
        B = next(b for b in self.batch_sizes if b >= len(live))
        empty = self._empty()
        rows1, last = [empty] * B, np.zeros((B, 1), np.int32)
        for i, r in enumerate(live):
            rows1[i] = self._cache_before_last(requests[r].seq_id, requests[r].tokens)
            last[i, 0] = int(requests[r].tokens[-1])
        after, cache = self._advance(last, _stack_rows(tuple(rows1)))
        if self.samples:
            temperature, seed = np.zeros(B, np.float32), np.zeros(B, np.uint32)
            choice, gen_step = np.zeros(B, np.int32), np.zeros(B, np.int32)
            for i, r in enumerate(live):
                req = requests[r]
                temperature[i], seed[i] = max(float(req.temperature), 0.0), int(req.seed) & 0xFFFFFFFF
                choice[i], gen_step[i] = int(req.choice), int(req.gen_step)
        steps = max(limits.values())
        explored, tokens, qs = [cache], [], []
        for step in range(steps):
            if self.samples:
                tok, q = _draw_rows(after, temperature, seed, choice, gen_step + np.int32(step))
                qs.append(q)
            else:
                tok = after
            tokens.append(tok)
            if step < steps - 1:
                after, cache = self._advance(tok.reshape(B, 1), cache)
                explored.append(cache)
        if self.samples:
            qs += [jnp.zeros_like(qs[0])] * (self.k - len(qs))
            slot_of_row = np.full(B, self.rows, np.int32)  # padding rows: out of range, dropped
            slot_of_row[:len(live)] = live
            self._q_packed = _q_rows(tuple(qs))
            self._q = _q_by_request(self._q_packed, slot_of_row, self.rows)
        ids = np.asarray(jax.device_get(tokens)).reshape(steps, B)
        out = [[] for _ in requests]
        for i, r in enumerate(live):
            req = requests[r]
            out[r] = ids[:limits[r], i].tolist()
            self._seqs[req.seq_id] = _DraftState(list(req.tokens), explored[:limits[r]], i, out[r],
                                                 self.samples and req.temperature > 0)
        return out

    def q(self, seq_id):
        """The distributions the last proposal for ``seq_id`` sampled its drafts from: float32 ``[k, V]`` on the
        device (row i for draft i + 1), or None when it drafted greedily. Valid until the next proposal."""
        state = self._seqs.get(seq_id)
        return None if state is None or not state.sampled else self._q_packed[state.row]

    def sampled(self, seq_id) -> bool:
        """Whether the last proposal for ``seq_id`` sampled its drafts (``q(seq_id)``; its request's row of
        ``batch_q()``)."""
        state = self._seqs.get(seq_id)
        return state is not None and state.sampled

    def batch_q(self):
        """The last proposal's q of every row, float32 ``[rows, k, V]`` on the device (row r = request r; rows that
        drafted greedily or not at all hold values the verify program ignores), or None when not sampling."""
        return self._q

    def forget(self, seq_id) -> None:
        """Drop a finished (or preempted) sequence's cache."""
        self._seqs.pop(seq_id, None)

    def _empty(self):
        if self._zero1 is None:
            self._zero1 = self.model.new_cache(1, self.max_len)
        return self._zero1

    def _cache_before_last(self, seq_id, tokens: Sequence[int]):
        """A batch-1 cache over ``tokens[:-1]``: the longest one the sequence's last proposal explored (the context
        it had, then the drafts the target kept), fed the rest in chunks (``FEED_CHUNKS``). A context that does
        not extend the last one (another request under the same id, a preempted sequence recomputed) starts over."""
        state = self._seqs.get(seq_id)
        n = len(tokens) - 1
        if state is not None and n >= len(state.known) and list(tokens[:len(state.known)]) == state.known:
            base, at = len(state.known), 0
            while (at < len(state.explored) - 1 and base + at < n
                   and state.draft_ids[at] == int(tokens[base + at])):
                at += 1
            cache, fed = _take_row(state.explored[at], np.int32(state.row)), base + at
        else:
            cache, fed = self._empty(), 0
        while fed < n:
            c = next(c for c in FEED_CHUNKS if c <= n - fed)
            _, cache = self._advance(np.asarray([tokens[fed:fed + c]], np.int32), cache)
            fed += c
        return cache
