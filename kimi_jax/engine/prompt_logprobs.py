"""Prompt log-probabilities: how likely the model finds each token of a prompt given the tokens before it.

What lm-evaluation-harness's loglikelihood requests need (``/v1/completions`` with ``echo`` and ``logprobs``, and
vLLM's ``prompt_logprobs``).  The decode engine never materialises logits for prompt positions -- prefill chunks
return none and the tail tokens' samples are dropped -- so a prompt is scored by one full causal forward of the
model (the same function as ``Model.logits``), outside the batch: a prompt's scores never depend on what else runs.

Each prompt runs alone (batch 1), right-padded to a length bucket (powers of two from ``MIN_BUCKET``, capped at
``max_len``) so that a handful of programs serve every length; the padding follows the prompt, and the model is
causal, so it cannot reach the scored positions.  Only what the API returns leaves the device: per position the
prompt token's log-probability and rank, and the ``MAX_TOP_LOGPROBS`` most likely tokens -- never ``[T, V]``.

The scores are ``log_softmax`` of the raw logits in float32, as generated-token log-probs are (``sampler.py``).
The forward runs in the model's activation dtype without the paged cache: no ``kv_dtype`` quantisation, so in
bf16 a prompt token's score and the decode path's score of the same token may differ by bf16 rounding.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .param_leaves import ParamLeaves
from .sampling_params import MAX_TOP_LOGPROBS

MIN_BUCKET = 16


@dataclass
class PromptScores:
    """Scores of the prompt's tokens 1..T-1 (token 0 has no context: OpenAI reports null for it)."""

    logprobs: np.ndarray  # f32 [T-1]: log p(ids[t] | ids[:t]) for t = 1..T-1
    ranks: np.ndarray  # i32 [T-1]: 1 + the number of tokens strictly more likely than ids[t]
    top_ids: np.ndarray  # i32 [T-1, MAX_TOP_LOGPROBS]: most likely first
    top_logprobs: np.ndarray  # f32 [T-1, MAX_TOP_LOGPROBS]


def bucket_length(n: int, max_len: int) -> int:
    """The padded length a prompt of ``n`` tokens runs at."""
    b = MIN_BUCKET
    while b < n:
        b *= 2
    return max(n, min(b, max_len))


class PromptScorer:
    """Scores prompts with ``model``'s full forward; thread-safe (one prompt at a time: callers queue on a lock, so
    concurrent scoring never multiplies the device memory of the ``[T, V]`` logits)."""

    def __init__(self, model, max_len: int, mirror=None):
        """``mirror``: the server's `multihost.Mirror` (the scoring program then runs on every process)."""
        self.model = model
        self.max_len = int(max_len)
        self._lock = threading.Lock()
        self.programs: set[int] = set()  # bucket lengths compiled so far
        graphdef, ctx = model.graphdef, model.ctx
        k = min(MAX_TOP_LOGPROBS, model.config.vocab_size)

        def score(params, ids_1t):
            m = nnx.merge(graphdef, params)
            logits, _ = m(ids_1t, None, ctx=ctx, mla_form="absorbed", mm=None)
            lp = jax.nn.log_softmax(logits[0, :-1].astype(jnp.float32), axis=-1)  # [T-1, V]: predicts ids[1:]
            nxt = ids_1t[0, 1:]
            chosen = jnp.take_along_axis(lp, nxt[:, None], axis=-1)[:, 0]
            rank = 1 + jnp.sum(lp > chosen[:, None], axis=-1).astype(jnp.int32)
            top_lp, top_ids = jax.lax.top_k(lp, k)
            return chosen, rank, top_ids.astype(jnp.int32), top_lp

        mesh = getattr(model, "mesh", None)
        whole = {} if mesh is None else {"out_shardings": jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())}
        flat_params = ParamLeaves(model.params)
        jitted = jax.jit(flat_params.taking(score), **whole)  # replicated results: process 0 reads them whole
        program = lambda padded: jitted(flat_params.leaves, padded)
        self._score = program if mirror is None else mirror.register("prompt_scores", program)

    def score(self, ids: Sequence[int]) -> PromptScores:
        ids = [int(t) for t in ids]
        T = len(ids)
        if T > self.max_len:
            raise ValueError(f"a prompt of {T} tokens exceeds {self.max_len}")
        if T < 2:
            k = min(MAX_TOP_LOGPROBS, self.model.config.vocab_size)
            return PromptScores(np.zeros(0, np.float32), np.zeros(0, np.int32), np.zeros((0, k), np.int32),
                                np.zeros((0, k), np.float32))
        L = bucket_length(T, self.max_len)
        padded = np.zeros((1, L), np.int32)
        padded[0, :T] = ids
        with self._lock:
            out = self._score(padded)
            chosen, rank, top_ids, top_lp = (np.asarray(a) for a in out)
            self.programs.add(L)
        n = T - 1
        return PromptScores(chosen[:n], rank[:n], top_ids[:n], top_lp[:n])


def token_logprob_rows(scores: Optional[PromptScores], k: int) -> list:
    """Per prompt position (the first None): (logprob, rank, [(id, logprob)] * k) -- a plain-Python view."""
    if scores is None:
        return []
    rows: list = [None]
    for t in range(len(scores.logprobs)):
        top = [(int(scores.top_ids[t, j]), float(scores.top_logprobs[t, j])) for j in range(k)]
        rows.append((float(scores.logprobs[t]), int(scores.ranks[t]), top))
    return rows
