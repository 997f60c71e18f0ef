"""The batched sampler: one jitted function of fixed shape that applies every row's own parameters.

``sample(logits [B, V], rows, ctl, counts, prompt_mask, tables)`` runs inside the engine's decode step, in this order
(vLLM / OpenAI semantics, see ``SamplingParams``):

  1. raw log-probabilities ``log_softmax(logits)`` (what ``logprobs`` / ``top_logprobs`` report);
  2. ``logit_bias`` (sparse: ``MAX_LOGIT_BIAS`` (id, value) pairs per row, padding id = V is dropped);
  3. repetition penalty over prompt ∪ generated tokens, then frequency and presence penalties over generated ones;
  4. constraints: a vocabulary-class mask per row plus up to ``MAX_ALLOWED_IDS`` extra ids (guided decoding),
     and ``min_tokens`` (stop ids banned while too few tokens exist); everything else -> -inf;
  5. greedy rows (temperature 0) take the argmax; the others divide by the temperature, keep top-k, then the
     smallest top-p nucleus of the top-k distribution, then drop tokens below ``min_p · p_max``, and sample with the
     Gumbel-max trick from a per-row key ``fold_in(fold_in(PRNGKey(seed), choice), step)`` -- reproducible per
     request whatever else shares the batch.

The filter (a full sort of each row) only runs when some row uses top-k / top-p / min-p, and the top log-probs
(another sort) only when some row asks for them: two ``lax.cond``s on the rows' parameters. ``plain=True`` builds the
sampler without either (for steps where the host knows no running row needs them, `RowParams.needs_branches`): on a
GPU each ``lax.cond`` outside XLA's command buffers copies its predicate to the host and waits for the stream, which
keeps the host from running ahead of the device.
``RowParams`` holds per-row parameters on the host (numpy) and uploads them when a row changes.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .guide import ALL, MAX_ALLOWED_IDS
from .sampling_params import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, SamplingParams

__all__ = ["Rows", "Controls", "Tables", "SampleOut", "Processed", "RowParams", "sample", "process", "row_keys",
           "draw", "top_logprobs", "seed32", "uses_filter"]


class Rows(NamedTuple):
    """Per-row sampling parameters (device arrays, leading dim B)."""

    temperature: jax.Array  # f32
    top_p: jax.Array  # f32
    top_k: jax.Array  # i32, 0 = off
    min_p: jax.Array  # f32
    presence: jax.Array  # f32
    frequency: jax.Array  # f32
    repetition: jax.Array  # f32
    min_tokens: jax.Array  # i32
    seed: jax.Array  # u32
    choice: jax.Array  # i32, index of the sequence within its request (n > 1)
    bias_ids: jax.Array  # i32 [B, MAX_LOGIT_BIAS], padding = V
    bias_vals: jax.Array  # f32 [B, MAX_LOGIT_BIAS]
    top_logprobs: jax.Array  # i32: top log-probs the row returns (0: none; no row asking skips the top-k)


class Controls(NamedTuple):
    """Per-step inputs."""

    gen_step: jax.Array  # i32 [B]: tokens the row has generated so far (the RNG step, min_tokens)
    emit: jax.Array  # bool [B]: the row's output is a real token this step (else a prompt token is fed)
    allow_class: jax.Array  # i32 [B]: vocabulary class of allowed tokens (guide.ALL when free)
    allow_ids: jax.Array  # i32 [B, MAX_ALLOWED_IDS]: extra allowed ids, padding = V


class Tables(NamedTuple):
    """Constant per-vocabulary tables."""

    class_masks: jax.Array  # bool [NUM_VOCAB_CLASSES, V]
    stop_mask: jax.Array  # bool [V]: the tokenizer's end-of-turn ids (for min_tokens)


class SampleOut(NamedTuple):
    tokens: jax.Array  # i32 [B]
    logprob: jax.Array  # f32 [B]: raw log-probability of the chosen token
    top_ids: jax.Array  # i32 [B, min(MAX_TOP_LOGPROBS, V)]
    top_logprobs: jax.Array  # f32 [B, min(MAX_TOP_LOGPROBS, V)]


def seed32(seed: int) -> int:
    """Fold an arbitrary integer seed into 32 bits."""
    seed = int(seed) & ((1 << 64) - 1)
    return (seed ^ (seed >> 32)) & 0xFFFFFFFF


def uses_filter(temperature, top_k, top_p, min_p):
    """Per row, whether it samples through the top-k / top-p / min-p filter (numpy or jax arrays ``[B]``): the
    predicate of `process`'s ``lax.cond``, and its host twin in `RowParams.needs_branches`."""
    return (temperature > 0) & ((top_k > 0) | (top_p < 1.0) | (min_p > 0))


def _filter(xs, top_k, top_p, min_p):
    """Keep, per row, tokens at or above the tightest of the top-k, top-p and min-p thresholds."""
    V = xs.shape[-1]
    srt = -jnp.sort(-xs, axis=-1)  # descending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    kth = jnp.take_along_axis(srt, (k - 1)[:, None], axis=-1)
    in_k = jnp.arange(V)[None, :] < k[:, None]
    srt_k = jnp.where(in_k, srt, -jnp.inf)
    p = jax.nn.softmax(srt_k, axis=-1)
    before = jnp.cumsum(p, axis=-1) - p
    n_keep = jnp.maximum(jnp.sum((before < top_p[:, None]) & in_k, axis=-1), 1)
    pth = jnp.take_along_axis(srt_k, (n_keep - 1)[:, None], axis=-1)
    pth = jnp.where(top_p[:, None] >= 1.0, -jnp.inf, pth)
    mth = jnp.where(min_p[:, None] > 0, srt[:, :1] + jnp.log(jnp.maximum(min_p, 1e-30))[:, None], -jnp.inf)
    th = jnp.maximum(jnp.maximum(kth, pth), mth)
    return jnp.where(xs >= th, xs, -jnp.inf)


class Processed(NamedTuple):
    """One position's logits after steps 1-5's processing (see the module docstring), before the draw."""

    raw_lp: jax.Array  # f32 [B, V]: log_softmax of the raw logits (what logprobs report)
    greedy: jax.Array  # i32 [B]: argmax of the constrained logits (the token of temperature-0 rows)
    scaled: jax.Array  # f32 [B, V]: constrained logits / temperature, filtered (-inf outside the kept set)
    hot: jax.Array  # bool [B]: the row samples (temperature > 0)


def process(logits_bv, rows: Rows, ctl: Controls, counts_bv, prompt_mask_bv, tables: Tables,
            plain: bool = False) -> Processed:
    """Steps 1-5 up to the draw: raw log-probabilities, bias, penalties, constraints, temperature and filters.
    ``plain``: no filter (the caller knows no row uses one: `uses_filter` is False for every row it reads)."""
    B, V = logits_bv.shape
    logits = logits_bv.astype(jnp.float32)
    raw_lp = jax.nn.log_softmax(logits, axis=-1)
    b_idx = jnp.arange(B)[:, None]

    x = logits.at[b_idx, rows.bias_ids].add(rows.bias_vals, mode="drop")
    seen = counts_bv > 0
    rep = rows.repetition[:, None]
    x = jnp.where(seen | prompt_mask_bv, jnp.where(x > 0, x / rep, x * rep), x)
    x = x - rows.frequency[:, None] * counts_bv.astype(jnp.float32) - rows.presence[:, None] * seen

    allowed = tables.class_masks[ctl.allow_class]
    allowed = allowed.at[b_idx, ctl.allow_ids].set(True, mode="drop")
    banned_stop = (ctl.gen_step < rows.min_tokens)[:, None] & tables.stop_mask[None, :]
    strict = allowed & ~banned_stop
    allowed = jnp.where(jnp.any(strict, axis=-1, keepdims=True), strict, allowed)
    x = jnp.where(allowed, x, -jnp.inf)

    greedy_tok = jnp.argmax(x, axis=-1).astype(jnp.int32)
    hot = rows.temperature > 0
    xs = x / jnp.where(hot, rows.temperature, 1.0)[:, None]
    if not plain:
        need = jnp.any(uses_filter(rows.temperature, rows.top_k, rows.top_p, rows.min_p))
        xs = jax.lax.cond(need, _filter, lambda a, *_: a, xs, rows.top_k, rows.top_p, rows.min_p)
    return Processed(raw_lp, greedy_tok, xs, hot)


def row_keys(rows: Rows, gen_step_b):
    """Each row's PRNG key for its draw at generated-token index ``gen_step``: depends on the request only."""

    def row_key(seed, choice, step):
        return jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed), choice), step)

    return jax.vmap(row_key)(rows.seed, rows.choice, gen_step_b)


def draw(pr: Processed, keys):
    """The token of each row: the greedy argmax, or a Gumbel-max draw from ``pr.scaled`` with the row's key."""
    V = pr.scaled.shape[-1]
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (V,), jnp.float32))(keys)
    sampled = jnp.argmax(pr.scaled + gumbel, axis=-1).astype(jnp.int32)
    return jnp.where(pr.hot, sampled, pr.greedy)


def top_logprobs(raw_lp_bv, asked, plain: bool = False):
    """(ids ``[B, k]`` int32, log-probs ``[B, k]`` f32) of the k = ``MAX_TOP_LOGPROBS`` most likely tokens per row
    of ``raw_lp_bv [B, V]`` (raw distribution), computed only when some sequence asks (``asked``: the top log-probs
    each sequence returns, ``Rows.top_logprobs``), else zeros: on an accelerator the top-k over the vocabulary is a
    full sort (``lax.cond``). ``plain``: zeros, no ``lax.cond`` (the caller knows no row asks)."""
    k = min(MAX_TOP_LOGPROBS, raw_lp_bv.shape[-1])

    def top(lp):
        top_lp, top_ids = jax.lax.top_k(lp, k)
        return top_ids.astype(jnp.int32), top_lp

    none = lambda lp: (jnp.zeros(lp.shape[:-1] + (k,), jnp.int32), jnp.zeros(lp.shape[:-1] + (k,), lp.dtype))
    if plain:
        return none(raw_lp_bv)
    return jax.lax.cond(jnp.any(asked > 0), top, none, raw_lp_bv)


def sample(logits_bv, rows: Rows, ctl: Controls, counts_bv, prompt_mask_bv, tables: Tables, plain: bool = False):
    """One token per row. Returns (SampleOut, new counts) -- counts grow only on rows that emit. ``plain``: the
    sampler without the filter and the top log-probs (no ``lax.cond``), for rows none of which uses them
    (`RowParams.needs_branches`): the same outputs for those rows."""
    B = logits_bv.shape[0]
    pr = process(logits_bv, rows, ctl, counts_bv, prompt_mask_bv, tables, plain)
    tok = draw(pr, row_keys(rows, ctl.gen_step))
    chosen_lp = jnp.take_along_axis(pr.raw_lp, tok[:, None], axis=-1)[:, 0]
    top_ids, top_lp = top_logprobs(pr.raw_lp, rows.top_logprobs, plain)
    counts = counts_bv.at[jnp.arange(B), tok].add(ctl.emit.astype(counts_bv.dtype))
    return SampleOut(tok, chosen_lp, top_ids, top_lp), counts


class RowParams:
    """Host copy of ``Rows`` for ``B`` slots; ``device()`` uploads it again only after a change."""

    def __init__(self, batch: int, vocab_size: int):
        self.B, self.V = batch, vocab_size
        self.temperature = np.zeros(batch, np.float32)
        self.top_p = np.ones(batch, np.float32)
        self.top_k = np.zeros(batch, np.int32)
        self.min_p = np.zeros(batch, np.float32)
        self.presence = np.zeros(batch, np.float32)
        self.frequency = np.zeros(batch, np.float32)
        self.repetition = np.ones(batch, np.float32)
        self.min_tokens = np.zeros(batch, np.int32)
        self.seed = np.zeros(batch, np.uint32)
        self.choice = np.zeros(batch, np.int32)
        self.bias_ids = np.full((batch, MAX_LOGIT_BIAS), vocab_size, np.int32)
        self.bias_vals = np.zeros((batch, MAX_LOGIT_BIAS), np.float32)
        self.top_logprobs = np.zeros(batch, np.int32)
        self._device = None

    def set(self, slot: int, p: SamplingParams, seed: int, choice: int) -> None:
        self.temperature[slot] = p.temperature
        self.top_p[slot] = p.top_p
        self.top_k[slot] = min(p.top_k, self.V)  # any k ≥ the vocabulary keeps every token (and fits int32)
        self.min_p[slot] = p.min_p
        self.presence[slot] = p.presence_penalty
        self.frequency[slot] = p.frequency_penalty
        self.repetition[slot] = p.repetition_penalty
        self.min_tokens[slot] = p.min_tokens
        self.seed[slot] = seed32(seed)
        self.choice[slot] = choice
        self.top_logprobs[slot] = p.top_logprobs if p.logprobs else 0
        self.bias_ids[slot] = self.V
        self.bias_vals[slot] = 0.0
        for j, (tid, val) in enumerate(sorted(p.logit_bias.items())):
            self.bias_ids[slot, j] = tid
            self.bias_vals[slot, j] = val
        self._device = None

    def needs_branches(self, slots) -> bool:
        """Whether any of ``slots`` (the running sequences' slots) samples through the filter or returns top
        log-probs: else a step over them may run the ``plain`` sampler, whose outputs for those rows are the same."""
        slots = np.asarray(list(slots), np.int64)
        filt = uses_filter(self.temperature[slots], self.top_k[slots], self.top_p[slots], self.min_p[slots])
        return bool(np.any(filt) or np.any(self.top_logprobs[slots] > 0))

    def abstract(self) -> Rows:
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), self._host())

    def _host(self) -> Rows:
        return Rows(self.temperature, self.top_p, self.top_k, self.min_p, self.presence, self.frequency,
                    self.repetition, self.min_tokens, self.seed, self.choice, self.bias_ids, self.bias_vals,
                    self.top_logprobs)

    def device(self, put=jax.device_put) -> Rows:
        """The device copy, made by ``put`` (host `Rows` -> device `Rows`) after each change."""
        if self._device is None:
            # copy: on CPU device_put may alias the numpy buffer, which `set` later mutates
            self._device = put(jax.tree.map(np.copy, self._host()))
        return self._device


def empty_controls(batch: int, vocab_size: int) -> dict:
    """Host arrays of one step's ``Controls`` (all rows free, nothing emitted)."""
    return dict(
        gen_step=np.zeros(batch, np.int32),
        emit=np.zeros(batch, bool),
        allow_class=np.full(batch, ALL, np.int32),
        allow_ids=np.full((batch, MAX_ALLOWED_IDS), vocab_size, np.int32),
    )
