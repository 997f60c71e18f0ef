"""The batched sampler (kimi_jax/engine/sampler.py) against NumPy restatements of each rule.

Every call uses one shape (B = 256 rows, V = 16 tokens) so the jitted sampler compiles once for the whole file.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from kimi_jax.engine.guide import ALL, MAX_ALLOWED_IDS, NUM_VOCAB_CLASSES, ONLY_IDS, TEXT
from kimi_jax.engine.sampler import Controls, RowParams, Tables, sample, seed32
from kimi_jax.engine.sampling_params import ParamError, SamplingParams

B, V = 256, 16
STOP = 15  # the "end of turn" id of this toy vocabulary


@pytest.fixture(scope="module")
def run():
    fn = jax.jit(sample)
    masks = np.zeros((NUM_VOCAB_CLASSES, V), bool)
    masks[ALL] = True
    masks[TEXT, :12] = True  # ids 12..15 play control tokens
    stop_mask = np.zeros(V, bool)
    stop_mask[STOP] = True
    tables = Tables(masks, stop_mask)

    def go(logits, params, *, counts=None, prompt_mask=None, gen_step=0, emit=True, allow=None, seeds=None,
           choice=None):
        """params: one SamplingParams for all rows or a list of B.  allow: (class, ids) for all rows."""
        logits = np.broadcast_to(np.asarray(logits, np.float32), (B, V)).copy()
        rows = RowParams(B, V)
        plist = params if isinstance(params, list) else [params] * B
        for b, p in enumerate(plist):
            rows.set(b, p, seeds[b] if seeds is not None else (p.seed or 0), choice[b] if choice is not None else 0)
        counts = np.zeros((B, V), np.int32) if counts is None else np.broadcast_to(counts, (B, V)).astype(np.int32)
        pm = np.zeros((B, V), bool) if prompt_mask is None else np.broadcast_to(prompt_mask, (B, V)).copy()
        allow_class = np.full(B, ALL, np.int32)
        allow_ids = np.full((B, MAX_ALLOWED_IDS), V, np.int32)
        if allow is not None:
            allow_class[:] = allow[0]
            allow_ids[:, : len(allow[1])] = allow[1]
        ctl = Controls(np.full(B, gen_step, np.int32), np.full(B, emit, bool), allow_class, allow_ids)
        out, new_counts = fn(logits, rows.device(), ctl, counts, pm, tables)
        return jax.tree.map(np.asarray, out), np.asarray(new_counts)

    return go


def _logits(seed=0):
    return np.random.default_rng(seed).normal(0, 2.0, V).astype(np.float32)


def test_greedy_is_argmax_and_logprobs_are_raw(run):
    x = _logits(1)
    out, _ = run(x, SamplingParams(temperature=0.0, logprobs=True, top_logprobs=5))
    assert (out.tokens == np.argmax(x)).all()
    ref = x - np.log(np.sum(np.exp(x - x.max()))) - x.max()
    np.testing.assert_allclose(out.logprob[0], ref[np.argmax(x)], rtol=1e-5)
    order = np.argsort(-ref)
    np.testing.assert_array_equal(out.top_ids[0, :5], order[:5])
    np.testing.assert_allclose(out.top_logprobs[0, :5], ref[order[:5]], rtol=1e-5)


def test_top_logprobs_are_computed_only_when_a_row_asks(run):
    """The top-20 is a full sort on an accelerator: a step where no row asks returns zeros; one row asking gives
    every row its top log-probs (the engine reads them only for rows that asked)."""
    x = _logits(3)
    out, _ = run(x, SamplingParams(temperature=0.0, logprobs=True))
    assert not out.top_ids.any() and not out.top_logprobs.any()
    assert out.logprob[0] < 0  # the chosen token's log-prob is always there
    plist = [SamplingParams(temperature=0.0)] * (B - 1) + [SamplingParams(temperature=0.0, logprobs=True,
                                                                          top_logprobs=2)]
    out, _ = run(x, plist)
    np.testing.assert_array_equal(out.top_ids[:, :2], np.broadcast_to(np.argsort(-x)[:2], (B, 2)))


def test_logit_bias_forces_and_bans(run):
    x = _logits(2)
    forced = int(np.argmin(x))
    out, _ = run(x, SamplingParams(temperature=0.0, logit_bias={forced: 100.0}))
    assert (out.tokens == forced).all()
    best = int(np.argmax(x))
    out, _ = run(x, SamplingParams(temperature=0.0, logit_bias={best: -100.0}))
    assert (out.tokens == np.argsort(-x)[1]).all()
    # sampling with a +100 bias also always picks it; logprobs stay the raw model's
    out, _ = run(x, SamplingParams(temperature=1.0, logit_bias={forced: 100.0}), seeds=np.arange(B))
    assert (out.tokens == forced).all()
    assert out.logprob[0] < np.log(0.5)


def test_penalties_match_numpy(run):
    x = _logits(3)
    counts = np.zeros(V, np.int32)
    counts[[1, 4, 7]] = [1, 3, 2]
    prompt = np.zeros(V, bool)
    prompt[[2, 4, 9]] = True
    pres, freq, rep = 0.7, 0.4, 1.3
    ref = x.copy()
    hit = (counts > 0) | prompt
    ref[hit] = np.where(ref[hit] > 0, ref[hit] / rep, ref[hit] * rep)
    ref = ref - freq * counts - pres * (counts > 0)
    p = SamplingParams(temperature=0.0, presence_penalty=pres, frequency_penalty=freq, repetition_penalty=rep)
    out, _ = run(x, p, counts=counts, prompt_mask=prompt)
    assert out.tokens[0] == np.argmax(ref)
    # sampling follows the penalised distribution too: the penalised logits are what the filter / draw see
    p_ref = np.exp(ref - ref.max())
    p_ref /= p_ref.sum()
    hot = p.replace(temperature=1.0, top_p=0.5)
    out, _ = run(x, hot, counts=counts, prompt_mask=prompt, seeds=np.arange(B))
    order = np.argsort(-p_ref)
    nucleus = set(order[: int(np.searchsorted(np.cumsum(p_ref[order]), 0.5) + 1)])
    assert set(out.tokens) <= nucleus
    # the penalised token really moves: ban-by-frequency of the unpenalised argmax
    top = int(np.argmax(x))
    c2 = np.zeros(V, np.int32)
    c2[top] = 50
    out, _ = run(x, SamplingParams(temperature=0.0, frequency_penalty=2.0), counts=c2)
    assert out.tokens[0] != top


def test_counts_grow_only_on_emitting_rows(run):
    x = _logits(4)
    _, counts = run(x, SamplingParams(temperature=0.0), emit=True)
    assert counts.sum() == B and (counts[:, np.argmax(x)] == 1).all()
    _, counts = run(x, SamplingParams(temperature=0.0), emit=False)
    assert counts.sum() == 0


def test_sampling_distribution_matches_softmax(run):
    x = _logits(5) / 2
    out, _ = run(x, SamplingParams(temperature=1.0), seeds=np.arange(B) + 1000)
    p = np.exp(x - x.max())
    p /= p.sum()
    freq = np.bincount(out.tokens, minlength=V) / B
    assert np.abs(freq - p).max() < 0.09  # 256 draws: a few standard errors
    # temperature sharpens
    out_cold, _ = run(x, SamplingParams(temperature=0.2), seeds=np.arange(B) + 1000)
    assert np.mean(out_cold.tokens == np.argmax(x)) > np.mean(out.tokens == np.argmax(x))


def test_top_k_top_p_min_p_restrict_support(run):
    x = _logits(6)
    order = np.argsort(-x)
    seeds = np.arange(B) + 7
    out, _ = run(x, SamplingParams(temperature=1.5, top_k=3), seeds=seeds)
    assert set(out.tokens) <= set(order[:3]) and len(set(out.tokens)) > 1
    out, _ = run(x, SamplingParams(temperature=1.0, top_k=1), seeds=seeds)
    assert (out.tokens == order[0]).all()
    p = np.exp(x - x.max())
    p /= p.sum()
    cum = np.cumsum(p[order])
    nucleus = set(order[: int(np.searchsorted(cum, 0.6) + 1)])
    out, _ = run(x, SamplingParams(temperature=1.0, top_p=0.6), seeds=seeds)
    assert set(out.tokens) <= nucleus
    keep = set(np.nonzero(p >= 0.3 * p.max())[0])
    out, _ = run(x, SamplingParams(temperature=1.0, min_p=0.3), seeds=seeds)
    assert set(out.tokens) <= keep
    # per-row parameters: half the rows greedy, half top-k 2
    plist = [SamplingParams(temperature=0.0) if b % 2 else SamplingParams(temperature=1.0, top_k=2) for b in range(B)]
    out, _ = run(x, plist, seeds=seeds)
    assert (out.tokens[1::2] == order[0]).all() and set(out.tokens[0::2]) <= set(order[:2])


def test_seed_reproducible_and_independent_of_row(run):
    x = _logits(7)
    p = SamplingParams(temperature=1.0, seed=1234)
    seeds = np.full(B, 1234)
    a, _ = run(x, p, seeds=seeds, gen_step=3)
    b, _ = run(x, p, seeds=seeds, gen_step=3)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert len(set(a.tokens)) == 1  # same seed, choice and step on every row -> the same draw
    c, _ = run(x, p, seeds=seeds, gen_step=3, choice=np.arange(B))  # n > 1: choices draw differently
    assert len(set(c.tokens)) > 1
    assert seed32(2**40 + 5) != seed32(5) and 0 <= seed32(-1) < 2**32


def test_constraints_and_min_tokens(run):
    x = _logits(8)
    x[STOP] = 50.0  # the model wants to stop
    out, _ = run(x, SamplingParams(temperature=0.0))
    assert (out.tokens == STOP).all()
    out, _ = run(x, SamplingParams(temperature=0.0, min_tokens=2), gen_step=1)
    assert (out.tokens != STOP).all()
    out, _ = run(x, SamplingParams(temperature=0.0, min_tokens=2), gen_step=2)
    assert (out.tokens == STOP).all()
    out, _ = run(x, SamplingParams(temperature=1.0), allow=(ONLY_IDS, (3, 5)), seeds=np.arange(B))
    assert set(out.tokens) <= {3, 5}
    out, _ = run(x, SamplingParams(temperature=0.0), allow=(ONLY_IDS, (9,)))
    assert (out.tokens == 9).all()  # a single allowed id is forced...
    assert np.allclose(out.logprob, out.logprob[0]) and out.logprob[0] < 0  # ...and reports the model's logprob
    out, _ = run(x, SamplingParams(temperature=1.0), allow=(TEXT, ()), seeds=np.arange(B))
    assert (out.tokens < 12).all()


@pytest.mark.parametrize("kw,param", [
    (dict(temperature=3.0), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_k=-2), "top_k"),
    (dict(max_tokens=0), "max_tokens"), (dict(logit_bias={V + 5: 1.0}), "logit_bias"),
    (dict(logit_bias={1: 300.0}), "logit_bias"), (dict(top_logprobs=21), "top_logprobs"),
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(stop=("",)), "stop"), (dict(min_tokens=20, max_tokens=4), "min_tokens"),
])
def test_bad_sampling_params_name_the_parameter(kw, param):
    with pytest.raises(ParamError) as e:
        SamplingParams(**kw).validate(V)
    assert e.value.param == param


def test_speculative_acceptance_keeps_the_target_distribution():
    """SPEC §12: drafts from q, accepted with min(1, p/q), residual resampling and a bonus token -> the emitted
    tokens follow p exactly; greedy (one-hot) p and q reduce to exact-match acceptance."""
    from kimi_jax.engine.spec_decode import accept

    rng = np.random.default_rng(0)
    Vs, K, N = 5, 2, 40000
    p = rng.dirichlet(np.ones(Vs), K + 1).astype(np.float32)
    q = rng.dirichlet(np.ones(Vs), K).astype(np.float32)
    kd, ka = jax.random.split(jax.random.PRNGKey(0))
    drafts = jax.random.categorical(kd, np.log(np.broadcast_to(q, (N, K, Vs))), axis=-1)
    fn = jax.jit(accept)
    tokens, n = jax.tree.map(np.asarray, fn(np.broadcast_to(p, (N, K + 1, Vs)), np.broadcast_to(q, (N, K, Vs)),
                                            drafts, ka))
    assert n.min() >= 1 and n.max() == K + 1 and (n == 1).any()
    np.testing.assert_allclose(np.bincount(tokens[:, 0], minlength=Vs) / N, p[0], atol=0.012)
    second = tokens[n >= 2, 1]
    np.testing.assert_allclose(np.bincount(second, minlength=Vs) / len(second), p[1], atol=0.02)
    # greedy: accept while the draft equals the target argmax, then emit the target argmax
    onehot = lambda idx: np.eye(Vs, dtype=np.float32)[idx]
    pt = onehot([[1, 3, 0]])
    tok, n = fn(pt, onehot([[1, 2]]), np.array([[1, 2]]), ka)
    assert int(n[0]) == 2 and np.asarray(tok)[0, :2].tolist() == [1, 3]
    tok, n = fn(pt, onehot([[1, 3]]), np.array([[1, 3]]), ka)
    assert int(n[0]) == 3 and np.asarray(tok)[0].tolist() == [1, 3, 0]
