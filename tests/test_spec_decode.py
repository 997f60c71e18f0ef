"""Speculative decoding (SPEC §12): the prompt-lookup and draft-model proposers, the KDA roll-back (`modules.kda.commit`), the
acceptance rule fused into the verify program (`spec_decode.verify_sample`), and the engine end to end.

What must hold: greedy output with speculation equals greedy output without it, whatever the drafts (right, wrong or
partly right); sampled output follows the target distribution exactly; a row without drafts draws exactly what the
one-token step draws; nothing recompiles.  The engine here: 4 slots x 256 tokens, k = 3; its reference runs are the
same engine with the proposer switched off (the one-token ``step`` program).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kimi_jax.engine import Engine, EngineConfig, SamplingParams, TokenSequenceGuide, compile_watch
from kimi_jax.engine.ngram import NgramProposer
from kimi_jax.engine.sampler import Controls, RowParams, Tables, empty_controls, sample
from kimi_jax.engine.spec_decode import verify_sample
from kimi_jax.engine.spec_policy import SpecPolicy
from kimi_jax.modules.kda import KDACache, KimiDeltaAttention, commit
from kimi_jax.serve.parsers import K3OutputParser
from kimi_jax.serve.tool_guide import K3ToolCallGuideBuilder
from kimi_jax.tokenizer import Tokenizer

K = 3


# ================================================================================================== the proposer
def test_ngram_proposer_takes_the_latest_longest_match():
    p = NgramProposer(3, min_n=2, max_n=3)
    ctx = [1, 2, 3, 4, 5, 9, 2, 3]
    assert p.propose("a", ctx, 10) == [4, 5, 9]  # (2, 3) was followed by 4 5 9
    ctx += [4]
    assert p.propose("a", ctx, 10) == [5, 9, 2]  # the index grew with the context
    assert p.propose("a", ctx, 1) == [5]  # capped by the room left
    assert p.propose("a", ctx, 0) == []
    ctx2 = [7, 8, 1, 2, 5, 6, 0, 8, 1, 2]  # (8, 1, 2) occurred at 1..3
    assert p.propose("b", ctx2, 3) == [5, 6, 0]
    ctx3 = [1, 2, 7, 3, 1, 2, 9, 3, 1, 2]  # (3, 1, 2) matches at 3..5 -> 9; (1, 2)'s latest is also there
    assert p.propose("c", ctx3, 2) == [9, 3]
    assert p.propose("d", [1, 2, 3], 5) == []  # nothing repeats
    assert p.propose("e", [7, 7, 7, 7], 5) == [7, 7, 7]  # a run continues
    assert p.propose("f", [1, 2, 3, 1, 2, 3, 1, 2], 3) == [3, 1, 2]  # so does a cycle past the context's end
    assert NgramProposer(5, 2, 2).propose("g", [4, 1, 2, 1, 2], 9) == [1, 2, 1, 2, 1]


def test_ngram_proposer_prefers_the_longer_match():
    p = NgramProposer(2, min_n=1, max_n=2)
    # (5) last occurred before 6; (4, 5) occurred before 8
    assert p.propose("a", [4, 5, 8, 0, 5, 6, 1, 4, 5], 2) == [8, 0]


def test_ngram_proposer_reindexes_a_different_context_and_forgets():
    p = NgramProposer(2, min_n=1, max_n=1)
    assert p.propose("s", [1, 2, 1], 2) == [2, 1]
    assert p.propose("s", [3, 4, 3], 2) == [4, 3]  # same id, other tokens: not the old index
    p.forget("s")
    p.forget("never-seen")
    assert p.propose("s", [5, 6, 5], 1) == [6]


@pytest.mark.parametrize("kw", [dict(k=0), dict(k=2, min_n=0), dict(k=2, min_n=3, max_n=2)])
def test_ngram_proposer_rejects_bad_settings(kw):
    with pytest.raises(ValueError):
        NgramProposer(**kw)


# ================================================================================================== the draft model
def test_draft_model_proposer_drafts_its_greedy_continuation(tiny_model):
    """The draft model's drafts are its greedy chain: each one is the argmax of its logits over the context and the
    drafts before it (checked with one full forward). A context that grew keeps the cache (only what the explored
    caches lack is fed); a different one under the same id starts over; drafts stop at the room left and at the cache's length."""
    from kimi_jax.engine.draft_model import DraftModelProposer

    p = DraftModelProposer(tiny_model, 4, 128, vocab_size=tiny_model.config.vocab_size)
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 1000, 70).tolist()  # one 64-token chunk and six single tokens

    def assert_greedy_chain(ctx, drafts):
        logits = tiny_model.logits(np.array([ctx + drafts]))[0]
        assert drafts == logits[len(ctx) - 1:len(ctx) - 1 + len(drafts)].argmax(-1).tolist()

    d = p.propose("a", prompt, 10)
    assert len(d) == 4
    assert_greedy_chain(prompt, d)
    grown = prompt + d[:2] + [7]  # two drafts kept, then the target's own token
    calls, advance = [], p._advance
    p._advance = lambda ids, cache: calls.append(ids.shape[1]) or advance(ids, cache)
    d2 = p.propose("a", grown, 3)
    # the kept drafts' cache was explored already: one feed call (the target's token), then two draft steps
    assert calls == [1, 1, 1]
    p._advance = advance
    assert len(d2) == 3 and p._seqs["a"].known == grown
    assert_greedy_chain(grown, d2)
    other = rng.integers(0, 1000, 70).tolist()
    d3 = p.propose("a", other, 4)  # the same id, another context: not fed onto the old cache
    assert p._seqs["a"].known == other
    assert_greedy_chain(other, d3)
    assert p.propose("a", other, 0) == [] and p.propose("b", other * 2, 4) == []  # no room / past the cache
    p.forget("a")
    p.forget("never-seen")
    assert "a" not in p._seqs
    with pytest.raises(ValueError, match="vocabulary"):
        DraftModelProposer(tiny_model, 4, 128, vocab_size=tiny_model.config.vocab_size + 1)
    with pytest.raises(ValueError, match="positions"):
        DraftModelProposer(tiny_model, 4, tiny_model.config.max_position_embeddings + 1)
    with pytest.raises(ValueError, match=">= 1"):
        DraftModelProposer(tiny_model, 0, 128)


def test_draft_model_proposer_samples_its_drafts_from_q(tiny_model):
    """draft_sample_method probabilistic: draft i is a Gumbel-max draw from q_i = softmax(logits_i / T) with
    ``draft_keys(seed, choice, gen_step + i)`` (logits from one full forward over the context and the drafts before
    it), ``q()`` holds those distributions, the same seed drafts the same tokens, and a greedy row (T = 0) drafts the
    argmax chain with no q."""
    from kimi_jax.engine.draft_model import DraftModelProposer, draft_keys

    p = DraftModelProposer(tiny_model, 4, 128, vocab_size=tiny_model.config.vocab_size, sample_method="probabilistic")
    V, T, seed, choice, step = tiny_model.config.vocab_size, 0.9, 12345, 1, 6
    prompt = np.random.default_rng(2).integers(0, 1000, 20).tolist()
    d = p.propose("a", prompt, 10, temperature=T, seed=seed, choice=choice, gen_step=step)
    assert len(d) == 4
    logits = tiny_model.logits(np.array([prompt + d]))[0, len(prompt) - 1:len(prompt) + 3].astype(np.float64) / T
    q_want = np.exp(logits - logits.max(-1, keepdims=True))
    q_want /= q_want.sum(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(p.q("a")), q_want, atol=2e-5)
    for i, tok in enumerate(d):
        g = np.asarray(jax.random.gumbel(draft_keys(seed, choice, step + i), (V,), jnp.float32))
        assert tok == int(np.argmax(logits[i] + g))
    assert p.propose("b", prompt, 10, temperature=T, seed=seed, choice=choice, gen_step=step) == d
    other = p.propose("c", prompt, 10, temperature=T, seed=seed + 1, choice=choice, gen_step=step)
    assert other != d  # another seed, other draws (1024 tokens: a repeat of all four is vanishingly unlikely)
    greedy = p.propose("a", prompt + d[:1] + [5], 3)
    assert p.q("a") is None
    full = tiny_model.logits(np.array([prompt + d[:1] + [5] + greedy]))[0]
    assert greedy == full[len(prompt) + 1:len(prompt) + 4].argmax(-1).tolist()
    with pytest.raises(ValueError, match="draft sample method"):
        DraftModelProposer(tiny_model, 4, 128, sample_method="typical")


@pytest.mark.parametrize("method", ["greedy", "probabilistic"])
def test_a_batched_proposal_drafts_what_each_row_drafts_alone(tiny_model, method):
    """``propose_batch`` (the engine's path: row = slot) runs every row's draft steps in one batch: each row gets
    the drafts it would get alone -- greedy chains, or draws with the same keys -- through new prompts, resumed
    contexts (kept drafts and the target's token), a row left out, a sequence that moved to another row, and rows
    of different room; the drafting rows are packed into batches of 1, 2 or 3."""
    from kimi_jax.engine.draft_model import DraftModelProposer, DraftRequest

    V = tiny_model.config.vocab_size
    batched = DraftModelProposer(tiny_model, 3, 160, vocab_size=V, sample_method=method, rows=3)
    alone = DraftModelProposer(tiny_model, 3, 160, vocab_size=V, sample_method=method)
    rng = np.random.default_rng(4)
    ctx = {s: rng.integers(0, 1000, n).tolist() for s, n in (("a", 66), ("b", 5), ("c", 1))}
    kw = {s: dict(temperature=0.0 if s == "c" else 0.8, seed=31 + i, choice=i, gen_step=0)
          for i, s in enumerate("abc")}
    layouts = [("a", "b", "c"), ("a", None, "c"), ("c", "a", "b"), (None, "b", None), ("b", "c", "a")]
    for step, layout in enumerate(layouts):
        reqs = [None if s is None else DraftRequest(s, ctx[s], 1 + (i + step) % 3, **kw[s])
                for i, s in enumerate(layout)]
        got = batched.propose_batch(reqs)
        for r, req in enumerate(reqs):
            if req is None:
                assert got[r] == []
                continue
            want = alone.propose(req.seq_id, req.tokens, req.max_tokens, **kw[req.seq_id])
            assert got[r] == want, (step, req.seq_id)
            if method == "probabilistic" and kw[req.seq_id]["temperature"] > 0:
                np.testing.assert_allclose(np.asarray(batched.q(req.seq_id))[:len(want)],
                                           np.asarray(alone.q(req.seq_id))[:len(want)], atol=1e-5)
            else:
                assert not batched.sampled(req.seq_id)
            # the target keeps the first draft, then emits a token of its own; the next proposal resumes there
            ctx[req.seq_id] = ctx[req.seq_id] + want[:1] + [int(rng.integers(0, 1000))]
            kw[req.seq_id]["gen_step"] += 2
    assert batched.batch_sizes == (1, 2, 3)
    with pytest.raises(ValueError, match="batches 3"):
        batched.propose_batch([None] * 4)


# ================================================================================================== the policy
def test_policy_verifies_while_drafts_are_expected_to_pay():
    pol = SpecPolicy(cost=1.2)
    assert pol.expected_accepted("a", 4) == pytest.approx(0.5 + 0.25 + 0.125 + 0.0625)  # the prior rate, 0.5
    assert pol.worth_verifying({"a": 4}, active_rows=1)  # 1.94 tokens for 1.2x the time
    assert not pol.worth_verifying({"a": 4}, active_rows=32)  # 32.94 tokens for 1.2x: no
    assert not pol.worth_verifying({}, active_rows=1)
    for _ in range(6):  # every draft rejected: the sequence stops causing verify steps
        pol.observe("a", 4, 0)
    assert pol.rate("a") < 0.15 and not pol.worth_verifying({"a": 4}, active_rows=1)
    steps = 0
    while not pol.worth_verifying({"a": 4}, active_rows=1):  # ...for a while: its rate recovers towards the prior
        pol.idle("a")
        steps += 1
    assert 3 <= steps <= 40
    for _ in range(10):  # drafts that are always kept: worth it even in a full batch of such rows
        for s in range(32):
            pol.observe(s, 4, 4)
    assert pol.worth_verifying({s: 4 for s in range(32)}, active_rows=32)
    pol.forget("a")
    assert pol.rate("a") == 0.5
    assert SpecPolicy(adaptive=False).worth_verifying({"a": 1}, active_rows=1000)


def test_policy_rate_is_kept_over_kept_plus_rejections():
    """A verify step is a run of kept drafts ended by one rejection (or by the last draft): the per-draft rate is
    kept / (kept + rejections), with the prior counting for one draft."""
    pol = SpecPolicy(memory=1.0)
    pol.observe("a", 4, 2)  # 2 kept, then a rejection
    assert pol.rate("a") == pytest.approx((2 + 0.5) / (2 + 1 + 1))
    pol.observe("a", 4, 4)  # all kept: no rejection
    assert pol.rate("a") == pytest.approx((6 + 0.5) / (6 + 1 + 1))
    for _ in range(3):  # quick to trust drafts that are kept (a running mean sat at 0.83 here)
        pol.observe("b", 4, 4)
    assert SpecPolicy().rate("b") == 0.5 and pol.rate("b") > 0.95


def test_policy_expects_as_many_kept_drafts_as_a_geometric_source_gives():
    """Drafts kept with a fixed chance each until the first rejection: the expected count tracks the real mean
    (the kept fraction kept / drafted, used before, expected 2.2 of 4 at a = 0.9 where 3.1 are kept)."""
    rng = np.random.default_rng(0)
    for a in (0.3, 0.6, 0.9):
        pol, kept, expected = SpecPolicy(), [], []
        for _ in range(3000):
            expected.append(pol.expected_accepted("s", 4))
            k = 0
            while k < 4 and rng.random() < a:
                k += 1
            pol.observe("s", 4, k)
            kept.append(k)
        assert np.mean(expected[100:]) == pytest.approx(np.mean(kept[100:]), rel=0.12, abs=0.06)


def test_policy_measures_the_cost_ratio():
    pol = SpecPolicy()
    assert pol.cost(1) == 1.5  # nothing timed yet
    pol.timed(False, 0.010, 1)
    for _ in range(3):
        pol.timed(True, 0.016, 1)
    assert pol.cost(1) == pytest.approx(1.6)
    pol.timed(False, 0.012, 30)
    assert pol.cost(32) == 1.5  # no verify step timed at this occupancy yet: 1 row's ratio is not used
    pol.timed(True, 0.0144, 32)
    assert pol.cost(31) == pytest.approx(1.2)
    for _ in range(40):
        pol.timed(True, 0.008, 1)  # faster than a step (noise): never below 1
    assert pol.cost(1) == 1.0


def test_policy_is_not_switched_off_by_one_slow_step():
    """The first verify step timed at an occupancy may absorb other work (the batch's prefills): one slow sample
    caps at the initial ratio until more are timed, and the median then sets it aside; so do slow one-token steps."""
    pol = SpecPolicy()
    for _ in range(5):
        pol.timed(False, 0.010, 32)
    pol.timed(True, 0.032, 32)  # 3.2x: the session-26 outlier on the H200
    assert pol.cost(32) == 1.5 and pol.worth_verifying({s: 4 for s in range(32)}, active_rows=32)
    pol.timed(True, 0.012, 32)
    pol.timed(True, 0.012, 32)
    assert pol.cost(32) == pytest.approx(1.2)
    pol.timed(False, 0.050, 32)  # one slow step among six
    assert pol.cost(32) == pytest.approx(1.2)
    for _ in range(3):  # a real change of the ratio does come through
        pol.timed(True, 0.030, 32)
    assert pol.cost(32) == pytest.approx(3.0)
    with pytest.raises(ValueError):
        SpecPolicy(cost=0)


# ================================================================================================== KDA roll-back
def test_kda_commit_keeps_exactly_the_accepted_prefix(tiny_model):
    """A deferred pass over T tokens, committed at keep[b], leaves the state and conv tails that running only the
    first keep[b] tokens leaves (the engine's decode op, token by token)."""
    cfg = tiny_model.config
    layer = KimiDeltaAttention(cfg.hidden_size, cfg.kda, rngs=nnx.Rngs(0))
    B, T = 3, K + 1
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((B, T, cfg.hidden_size)), jnp.float32)
    start = KDACache.zeros(B, cfg.kda, jnp.float32)
    _, start = layer(jnp.asarray(rng.standard_normal((B, 5, cfg.hidden_size)), jnp.float32), start)  # some history
    out_defer, pending = layer(x, start, defer=True)
    out_full, _ = layer(x, start, use_chunk=False)
    np.testing.assert_array_equal(np.asarray(out_defer), np.asarray(out_full))  # outputs don't wait for the commit
    keep = np.array([0, 2, 4])
    got = commit(pending, keep)
    for b, n in enumerate(keep):
        row = jax.tree.map(lambda a: a[b:b + 1], start)
        for t in range(n):  # one token at a time, as decode runs them
            _, row = layer(x[b:b + 1, t:t + 1], row)
        for name, want, have in zip(KDACache._fields, row, got):
            np.testing.assert_allclose(np.asarray(have[b]), np.asarray(want[0]), rtol=1e-6, atol=1e-6,
                                       err_msg=f"{name}, keep {n}")


# ================================================================================================== acceptance
def _rows(B, V, temperature, **kw):
    rp = RowParams(B, V)
    for b in range(B):
        rp.set(b, SamplingParams(temperature=float(temperature[b]), **kw), seed=1000 + b, choice=0)
    return rp.device()


def _ctl(B, V, gen_step=0):
    c = empty_controls(B, V)
    c["emit"][:] = True
    c["gen_step"][:] = gen_step
    return Controls(**c)


def _tables(V, stop=()):
    masks = np.ones((1, V), bool)
    stop_mask = np.zeros(V, bool)
    stop_mask[list(stop)] = True
    return Tables(jnp.asarray(masks), jnp.asarray(stop_mask))


def test_a_row_without_drafts_draws_what_the_step_draws():
    B, V = 6, 50
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.standard_normal((B, K + 1, V)) * 3, jnp.float32)
    rows = _rows(B, V, [0.0, 0.7, 1.0, 1.3, 0.0, 0.9], top_p=0.9, top_k=20)
    ctl, tables = _ctl(B, V, gen_step=7), _tables(V)
    counts = jnp.zeros((B, V), jnp.int32)
    mask = jnp.zeros((B, V), bool)
    drafts = jnp.asarray(rng.integers(0, V, (B, K)), jnp.int32)
    out, counts_v = jax.jit(verify_sample)(logits, drafts, jnp.zeros(B, jnp.int32), rows, ctl, counts, mask, tables)
    want, counts_s = jax.jit(sample)(logits[:, 0], rows, ctl, counts, mask, tables)
    assert np.asarray(out.n).tolist() == [1] * B
    np.testing.assert_array_equal(np.asarray(out.tokens[:, 0]), np.asarray(want.tokens))
    np.testing.assert_array_equal(np.asarray(out.logprob[:, 0]), np.asarray(want.logprob))
    np.testing.assert_array_equal(np.asarray(out.top_ids[:, 0]), np.asarray(want.top_ids))
    np.testing.assert_array_equal(np.asarray(counts_v), np.asarray(counts_s))


def test_greedy_rows_accept_while_the_draft_is_the_argmax():
    V = 10
    logits = np.full((1, K + 1, V), -5.0, np.float32)
    argmax = [3, 1, 4, 8]
    for i, a in enumerate(argmax):
        logits[0, i, a] = 5.0
    rows, ctl, tables = _rows(1, V, [0.0]), _ctl(1, V), _tables(V)
    z = jnp.zeros((1, V), jnp.int32), jnp.zeros((1, V), bool)
    fn = jax.jit(verify_sample)
    for drafts, n_draft, want in [([3, 1, 4], 3, [3, 1, 4, 8]),  # all kept + the bonus token
                                  ([3, 2, 4], 3, [3, 1]),  # second rejected: the argmax replaces it
                                  ([3, 1, 4], 1, [3, 1]),  # only one draft valid: its bonus
                                  ([0, 1, 4], 3, [3])]:
        out, counts = fn(jnp.asarray(logits), jnp.asarray([drafts], jnp.int32), jnp.asarray([n_draft], jnp.int32),
                         rows, ctl, *z, tables)
        n = int(out.n[0])
        assert np.asarray(out.tokens[0, :n]).tolist() == want
        assert np.asarray(counts).sum() == n and all(np.asarray(counts)[0, t] >= 1 for t in want)


def test_min_tokens_bans_a_drafted_stop_token_at_its_position():
    V, stop = 8, 7
    logits = np.zeros((1, K + 1, V), np.float32)
    logits[0, :, stop] = 9.0  # the model wants to stop everywhere
    rows = _rows(1, V, [0.0], min_tokens=2)
    out, _ = jax.jit(verify_sample)(jnp.asarray(logits), jnp.asarray([[stop, stop, stop]], jnp.int32),
                                    jnp.asarray([3], jnp.int32), rows, _ctl(1, V), jnp.zeros((1, V), jnp.int32),
                                    jnp.zeros((1, V), bool), _tables(V, stop=(stop,)))
    # positions 0 and 1 (generated tokens 0, 1) may not stop: the first draft is rejected there
    assert int(out.n[0]) == 1 and int(out.tokens[0, 0]) != stop


def test_sampled_rows_follow_the_target_distribution():
    """Deterministic drafts, many rows with their own seeds: the first emitted token follows p_0, the second
    (when the first draft was kept) p_1 -- with drafts that are likely, unlikely and impossible (banned)."""
    N, V = 6000, 6
    rng = np.random.default_rng(3)
    base = rng.standard_normal((K + 1, V)).astype(np.float32)
    logits = jnp.asarray(np.broadcast_to(base, (N, K + 1, V)))
    rows = _rows(N, V, [0.8] * N, logit_bias={4: -100.0})  # token 4 practically impossible
    p = np.asarray(jax.nn.softmax((jnp.asarray(base).at[:, 4].add(-100.0)) / 0.8, axis=-1))
    ctl, tables = _ctl(N, V), _tables(V)
    z = jnp.zeros((N, V), jnp.int32), jnp.zeros((N, V), bool)
    fn = jax.jit(verify_sample)
    for d1 in (int(np.argmax(p[0])), int(np.argmin(p[0][:4])), 4):
        drafts = jnp.asarray(np.broadcast_to([d1, 0, 1], (N, K)), jnp.int32)
        out, _ = fn(logits, drafts, jnp.full((N,), K, jnp.int32), rows, ctl, *z, tables)
        toks, n = np.asarray(out.tokens), np.asarray(out.n)
        np.testing.assert_allclose(np.bincount(toks[:, 0], minlength=V) / N, p[0], atol=0.025)
        kept = toks[:, 0] == d1
        assert (n[kept] >= 2).all() and (n[~kept] == 1).all()
        if kept.sum() > 2000:
            np.testing.assert_allclose(np.bincount(toks[kept, 1], minlength=V) / kept.sum(), p[1], atol=0.035)


def _p_float64(logits_kv, temperature, top_k):
    """SPEC §12's p as a float64 NumPy transcription: temperature, then the top-k of each position, renormalised."""
    s = np.asarray(logits_kv, np.float64) / temperature
    keep = s >= np.sort(s, axis=-1)[:, -top_k][:, None]
    e = np.where(keep, np.exp(s - s.max(-1, keepdims=True)), 0.0)
    return e / e.sum(-1, keepdims=True)


def test_drafts_sampled_from_q_are_kept_with_min_1_p_over_q():
    """SPEC §12, draft_sample_method probabilistic: drafts drawn from the draft's q are kept with probability
    min(1, p/q), a rejection is resampled from norm(max(0, p − q)), so the emitted tokens follow the target's p
    (float64 NumPy, temperature and top-k applied). The chance the first draft is kept is Σ min(p, q) -- not the
    one-hot rule's Σ q·p. For a q near p, one far from it, and one with mass on a token p's top-k drops."""
    N, V, T, top_k = 8000, 6, 0.8, 5
    rng = np.random.default_rng(5)
    base = rng.standard_normal((K + 1, V)).astype(np.float32)
    p = _p_float64(base, T, top_k)
    dropped = int(np.argmin(base[0]))  # outside position 0's top 5
    logits = jnp.asarray(np.broadcast_to(base, (N, K + 1, V)))
    rows, ctl, tables = _rows(N, V, [T] * N, top_k=top_k), _ctl(N, V), _tables(V)
    z = jnp.zeros((N, V), jnp.int32), jnp.zeros((N, V), bool)
    fn = jax.jit(verify_sample)
    near = 0.8 * p[:K] + 0.2 / V
    far = rng.dirichlet(np.ones(V), K)
    on_dropped = far.copy()
    on_dropped[0] = 0.5 * far[0] + 0.5 * np.eye(V)[dropped]
    for q_kv in (near, far, on_dropped):
        q_kv = (q_kv / q_kv.sum(-1, keepdims=True)).astype(np.float32)
        q64 = q_kv.astype(np.float64)
        drafts = np.stack([rng.choice(V, N, p=q64[i] / q64[i].sum()) for i in range(K)], 1)
        out, _ = fn(logits, jnp.asarray(drafts, jnp.int32), jnp.full((N,), K, jnp.int32), rows, ctl, *z, tables,
                    jnp.asarray(np.broadcast_to(q_kv, (N, K, V))), jnp.ones((N, K), bool))
        toks, n = np.asarray(out.tokens), np.asarray(out.n)
        np.testing.assert_allclose(np.bincount(toks[:, 0], minlength=V) / N, p[0], atol=0.02)
        assert abs((n >= 2).mean() - np.minimum(p[0], q_kv[0]).sum()) < 0.02
        for i in (1, 2):  # the token after i kept drafts follows p_i
            sel = n >= i + 1
            np.testing.assert_allclose(np.bincount(toks[sel, i], minlength=V) / sel.sum(), p[i], atol=0.035)
        assert not (toks[:, 0] == dropped).any()


def test_rows_without_sampled_drafts_are_bit_identical_with_q():
    """``has_q`` False: the draft counts as one-hot whatever q holds, so the verify program with q gives the same
    bits as without (greedy and sampled rows, kept and rejected drafts)."""
    B, V = 8, 40
    rng = np.random.default_rng(7)
    logits = jnp.asarray(rng.standard_normal((B, K + 1, V)) * 2, jnp.float32)
    rows = _rows(B, V, [0.0, 0.7, 1.0, 1.3, 0.0, 0.9, 1.1, 0.6], top_p=0.95)
    ctl, tables = _ctl(B, V, gen_step=4), _tables(V)
    z = jnp.zeros((B, V), jnp.int32), jnp.zeros((B, V), bool)
    greedy = np.asarray(jnp.argmax(logits[:, :K], -1))
    drafts = np.where(rng.random((B, K)) < 0.5, greedy, rng.integers(0, V, (B, K))).astype(np.int32)
    n_draft = jnp.asarray(rng.integers(0, K + 1, B), jnp.int32)
    q = jnp.asarray(rng.dirichlet(np.ones(V), (B, K)), jnp.float32)
    fn = jax.jit(verify_sample)
    want, counts_w = fn(logits, jnp.asarray(drafts), n_draft, rows, ctl, *z, tables)
    got, counts_g = fn(logits, jnp.asarray(drafts), n_draft, rows, ctl, *z, tables, q, jnp.zeros((B, K), bool))
    for a, b in zip(want, got):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(counts_w), np.asarray(counts_g))


# ================================================================================================== the engine
class _Oracle:
    """Drafts the reference continuation, with every third proposal's second token and every fifth proposal's first
    token wrong: acceptance of all, some and none of the drafts."""

    k = K

    def __init__(self, runs):
        self.runs, self.calls = runs, 0

    def propose(self, key, ctx, limit):
        self.calls += 1
        ctx = list(ctx[0:len(ctx)])
        for full in self.runs:
            if full[:len(ctx)] == ctx:
                d = full[len(ctx):len(ctx) + min(K, limit)]
                if self.calls % 3 == 0 and len(d) > 1:
                    d[1] = (d[1] + 1) % 1000
                if self.calls % 5 == 0 and d:
                    d[0] = (d[0] + 1) % 1000
                return d
        return []

    def forget(self, key):
        pass


@pytest.fixture(scope="module")
def spec_engine(tiny_model):
    # verify whenever a row drafts (the adaptive policy's own tests swap it in)
    e = Engine(tiny_model, Tokenizer.tiny(), EngineConfig(max_num_seqs=4, max_model_len=256,
                                                          prefill_chunk_sizes=(64, 1), speculative_tokens=K,
                                                          speculative_adaptive=False))
    e.start()
    yield e
    e.shutdown()


def _without_speculation(engine, fn):
    proposer, engine.proposer = engine.proposer, None  # the engine thread reads it once per step
    try:
        return fn()
    finally:
        engine.proposer = proposer


def _prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(0, 1000, n).tolist() for n in (30, 70, 5)]


def test_greedy_output_and_logprobs_equal_decoding_without_speculation(spec_engine):
    prompts = _prompts()
    P = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=2)
    ref = _without_speculation(spec_engine, lambda: [spec_engine.generate(p, P)[0] for p in prompts])
    before = spec_engine.stats()
    proposer, spec_engine.proposer = spec_engine.proposer, _Oracle([p + r.token_ids for p, r in zip(prompts, ref)])
    try:
        streams = [spec_engine.submit(p, P) for p in prompts]  # together: rows with and without drafts
        got = [s.collect(1)[0][0] for s in streams]
    finally:
        spec_engine.proposer = proposer
    after = spec_engine.stats()
    for r, g in zip(ref, got):
        assert g.token_ids == r.token_ids and g.finish_reason == "length"
        np.testing.assert_allclose([t.logprob for t in g.logprobs], [t.logprob for t in r.logprobs], atol=1e-4)
        assert [[i for i, _ in t.top] for t in g.logprobs] == [[i for i, _ in t.top] for t in r.logprobs]
    drafted = after["spec_draft_tokens"] - before["spec_draft_tokens"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    assert 0 < accepted < drafted  # some drafts kept, some rejected
    # a stop token inside an accepted run ends the output right there
    stop = ref[0].token_ids[12]
    want = ref[0].token_ids[: ref[0].token_ids.index(stop) + 1]
    spec_engine.proposer = _Oracle([prompts[0] + ref[0].token_ids])
    try:
        out = spec_engine.generate(prompts[0], P.replace(stop_token_ids=(stop,)))[0]
    finally:
        spec_engine.proposer = proposer
    assert out.token_ids == want and out.finish_reason == "stop"


def test_prompt_lookup_drafts_are_accepted_on_repetitive_output(spec_engine):
    """A logit bias makes the output one token repeated; the n-gram drafts then hit from the third token on, and the
    output is what it is without speculation, cut exactly at max_tokens (drafts are capped by the room left)."""
    prompt = [11, 12, 13, 11, 12, 13, 11, 12]
    P = SamplingParams(max_tokens=17, temperature=0.0, ignore_eos=True, logit_bias={13: 100.0})
    ref = _without_speculation(spec_engine, lambda: spec_engine.generate(prompt, P)[0].token_ids)
    assert ref == [13] * 17
    before = spec_engine.stats()
    got = spec_engine.generate(prompt, P)[0]
    after = spec_engine.stats()
    assert got.token_ids == ref and got.finish_reason == "length"
    assert after["spec_accepted_tokens"] - before["spec_accepted_tokens"] >= 6


def test_sampled_output_is_reproducible_and_independent_of_the_batch(spec_engine):
    prompt = [21, 22, 23, 24] * 6
    P = SamplingParams(max_tokens=24, temperature=0.8, seed=5, ignore_eos=True)
    alone = spec_engine.generate(prompt, P)[0].token_ids
    others = [spec_engine.submit([31, 32, 33] * 5 + [i], SamplingParams(max_tokens=20, temperature=1.0,
                                                                         ignore_eos=True)) for i in range(3)]
    together = spec_engine.submit(prompt, P).collect(1)[0][0].token_ids
    for s in others:
        s.collect(1)
    assert together == alone and len(alone) == 24


def test_penalties_apply_per_drafted_position(spec_engine):
    """Frequency / presence / repetition penalties at position i count the drafts before it: with a bias that makes
    the output repeat until the penalties push it elsewhere, drafts are kept while they hold and rejected where the
    penalties turn -- and the output is what one-token decoding gives."""
    prompt = [61, 62, 63] * 5
    cases = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, frequency_penalty=0.4,
                            logit_bias={13: 10.0, 14: 9.0, 15: 8.0}),
             SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, presence_penalty=1.5,
                            repetition_penalty=1.3, logit_bias={13: 10.0, 14: 9.5}),
             SamplingParams(max_tokens=40, temperature=0.7, seed=11, ignore_eos=True, frequency_penalty=0.2,
                            logit_bias={13: 10.0, 14: 9.0})]
    ref = _without_speculation(spec_engine, lambda: [spec_engine.generate(prompt, p)[0].token_ids for p in cases])
    assert len(set(ref[0])) > 1  # the penalty does turn the output
    before = spec_engine.stats()
    got = [s.collect(1)[0][0].token_ids for s in [spec_engine.submit(prompt, p) for p in cases]]
    after = spec_engine.stats()
    assert got[:2] == ref[:2]  # greedy: identical
    assert len(got[2]) == 40 and spec_engine.generate(prompt, cases[2])[0].token_ids == got[2]  # seeded: repeatable
    assert after["spec_accepted_tokens"] > before["spec_accepted_tokens"]
    assert after["spec_draft_tokens"] - before["spec_draft_tokens"] > after["spec_accepted_tokens"] - before[
        "spec_accepted_tokens"]  # and some rejected


def test_a_forced_run_is_drafted_and_kept_in_one_step(spec_engine):
    """What a guide forces is drafted outright: a sequence of three forced tokens takes one verify step."""
    prompt = [41, 42, 43] * 8
    guided = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=True)
    guide = lambda: TokenSequenceGuide([5, 6, 7])
    ref = _without_speculation(spec_engine, lambda: spec_engine.generate(prompt, guided, guide_factory=guide)[0])
    before = spec_engine.stats()
    got = spec_engine.generate(prompt, guided, guide_factory=guide)[0]
    after = spec_engine.stats()
    assert got.token_ids == ref.token_ids == [5, 6, 7] and got.finish_reason == "stop"
    np.testing.assert_allclose([t.logprob for t in got.logprobs], [t.logprob for t in ref.logprobs], atol=1e-4)
    assert after["spec_verify_steps"] - before["spec_verify_steps"] == 1
    assert after["spec_accepted_tokens"] - before["spec_accepted_tokens"] == 3  # the bonus token after 7 is dropped


def test_guided_tool_calls_with_drafts_equal_decoding_without(spec_engine):
    """A K3 tool-call guide (forced structure, a name from a trie, typed arguments) beside free rows: forced tokens
    and allowed lookup tokens are drafted, each position under the guide's state after the drafts before it; the
    greedy output equals one-token decoding and parses into the call."""
    tok = Tokenizer.tiny()
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                         "unit": {"enum": ["c", "f"]}}, "required": ["city", "days", "unit"]}}}]
    builder = K3ToolCallGuideBuilder(tok, tools, thinking=False, max_tokens=200, max_string_tokens=6)
    prompt = tok.encode("weather weather in Paris Paris please") * 2
    P = SamplingParams(max_tokens=200, temperature=0.0)
    guide = lambda: builder.build("get_weather")
    free = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logit_bias={13: 100.0})
    ref = _without_speculation(spec_engine, lambda: spec_engine.generate(prompt, P, guide_factory=guide)[0].token_ids)
    before = compile_watch.compile_count(), spec_engine.stats()
    streams = [spec_engine.submit(prompt, P, guide_factory=guide), spec_engine.submit(prompt, free)]
    got = streams[0].collect(1)[0][0].token_ids
    assert streams[1].collect(1)[0][0].token_ids == [13] * 30
    after = spec_engine.stats()
    assert got == ref
    parser = K3OutputParser(tok, thinking=False)
    parser.feed_many(got)
    res = parser.result()
    assert res.finish_reason == "tool_calls" and res.tool_calls[0]["function"]["name"] == "get_weather"
    assert after["spec_accepted_tokens"] - before[1]["spec_accepted_tokens"] > len(got) // 3
    assert compile_watch.compile_count() == before[0]


def test_adaptive_policy_stops_verifying_drafts_that_fail(spec_engine):
    """Drafts that are always wrong: with the adaptive policy (cost fixed at 1.2 so the test does not depend on
    timing) most steps are one-token steps again, and the output is unchanged."""
    prompt = [51, 52, 53, 54] * 4
    P = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    ref = _without_speculation(spec_engine, lambda: spec_engine.generate(prompt, P)[0].token_ids)

    class Wrong:
        k = K

        def propose(self, key, ctx, limit):
            return [(ctx[len(ctx) - 1] + 1) % 1000] * min(K, limit)

        def forget(self, key):
            pass

    saved = spec_engine.proposer, spec_engine.spec_policy
    spec_engine.proposer, spec_engine.spec_policy = Wrong(), SpecPolicy(cost=1.2)
    try:
        before = spec_engine.stats()["spec_verify_steps"]
        out = spec_engine.generate(prompt, P)[0].token_ids
        verified = spec_engine.stats()["spec_verify_steps"] - before
    finally:
        spec_engine.proposer, spec_engine.spec_policy = saved
    assert out == ref
    assert 2 <= verified <= 15  # tried, given up, tried again now and then -- not 39 verify steps


def test_preemption_with_drafts_in_flight_gives_identical_outputs(tiny_model):
    """A pool of 6 pages for 4 slots: drafts take pages ahead of their sequence's length, sequences are preempted
    and recomputed -- every output equals the one its request gets alone, and every page comes back."""
    eng = Engine(tiny_model, Tokenizer.tiny(), EngineConfig(max_num_seqs=4, max_model_len=256,
                                                            prefill_chunk_sizes=(64,), num_blocks=7,
                                                            speculative_tokens=K, speculative_adaptive=False)).start()
    rng = np.random.default_rng(7)
    prompt = lambda n: rng.integers(0, 1000, n).tolist()
    try:
        reqs = [(prompt(70), SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True,
                                            logit_bias={13: 100.0}), 1),  # drafts hit
                (prompt(90), SamplingParams(max_tokens=90, temperature=0.0, ignore_eos=True), 1),
                (prompt(40) * 2, SamplingParams(max_tokens=80, temperature=0.8, seed=3, ignore_eos=True), 1),
                (prompt(40), SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True,
                                            logit_bias={7: 100.0, 8: 100.0}), 2)]
        alone = [[o.token_ids for o in eng.generate(ids, p, n=n)] for ids, p, n in reqs]
        assert eng.stats()["num_preemptions"] == 0
        streams = [eng.submit(ids, p, n=n) for ids, p, n in reqs]
        together = [[o.token_ids for o in s.collect(n)[0]] for s, (_, _, n) in zip(streams, reqs)]
        st = eng.stats()
        assert st["num_preemptions"] > 0 and st["spec_accepted_tokens"] > 0
        assert together == alone
        assert st["free_blocks"] + st["prefix_cache_blocks"] == st["total_blocks"] == 6 and st["free_slots"] == 4
    finally:
        eng.shutdown()


def test_a_draft_model_drafts_and_the_output_is_the_targets(tiny_model):
    """`speculative_method="draft"`: another tiny model (other random weights) drafts greedily; the target keeps
    what it would have produced, so greedy output equals decoding without speculation, and nothing compiles after
    start. With the target itself as the draft model (swapped in) nearly every draft is kept."""
    import dataclasses

    from kimi_jax.engine.draft_model import DraftModelProposer
    from kimi_jax.model import random_model

    draft = random_model(dataclasses.replace(tiny_model.config), seed=1)
    eng = Engine(tiny_model, Tokenizer.tiny(), EngineConfig(max_num_seqs=2, max_model_len=128,
                                                            prefill_chunk_sizes=(64, 1), speculative_tokens=K,
                                                            speculative_method="draft", speculative_adaptive=False),
                 draft_model=draft).start()
    try:
        assert isinstance(eng.proposer, DraftModelProposer) and eng.proposer.model is draft
        compiled = eng.stats()["compilations"]
        prompts = [np.random.default_rng(i).integers(0, 1000, n).tolist() for i, n in ((3, 70), (4, 9))]
        P = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
        ref = _without_speculation(eng, lambda: [eng.generate(p, P)[0].token_ids for p in prompts])
        before = eng.stats()
        got = [s.collect(1)[0][0].token_ids for s in [eng.submit(p, P) for p in prompts]]
        after = eng.stats()
        assert got == ref
        assert after["spec_draft_tokens"] > before["spec_draft_tokens"]
        assert after["compilations"] == compiled  # the draft's feed programs were compiled at start
        eng.proposer = DraftModelProposer(tiny_model, K, 128 + K, vocab_size=tiny_model.config.vocab_size)
        eng.proposer.warmup()
        before = eng.stats()
        again = [eng.generate(p, P)[0].token_ids for p in prompts]
        after = eng.stats()
        assert again == ref
        drafted = after["spec_draft_tokens"] - before["spec_draft_tokens"]
        accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
        assert drafted > 0 and accepted >= 0.8 * drafted, (accepted, drafted)
    finally:
        eng.shutdown()


def test_a_draft_model_sampling_its_drafts(tiny_model):
    """draft_sample_method probabilistic in the engine: greedy requests still equal decoding without speculation;
    a seeded sampled request gives the same tokens every time; and with the target itself as the draft model at the
    same temperature, q = p, so min(1, p/q) keeps nearly every draft (the one-hot rule would keep each with
    probability p(d), a few percent over this random model's vocabulary). Nothing compiles after start."""
    import dataclasses

    from kimi_jax.model import random_model

    cfg = EngineConfig(max_num_seqs=2, max_model_len=128, prefill_chunk_sizes=(64, 1), speculative_tokens=K,
                       speculative_method="draft", speculative_adaptive=False, draft_sample_method="probabilistic")
    draft = random_model(dataclasses.replace(tiny_model.config), seed=1)
    prompts = [np.random.default_rng(i).integers(0, 1000, n).tolist() for i, n in ((3, 70), (4, 9))]
    G = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    S = SamplingParams(max_tokens=24, temperature=1.0, seed=7, ignore_eos=True)
    for draft_model in (draft, tiny_model):
        eng = Engine(tiny_model, Tokenizer.tiny(), cfg, draft_model=draft_model).start()
        try:
            assert eng.runner.draft_q and eng.proposer.samples
            compiled = eng.stats()["compilations"]
            if draft_model is draft:
                ref = _without_speculation(eng, lambda: [eng.generate(p, G)[0].token_ids for p in prompts])
                assert [s.collect(1)[0][0].token_ids for s in [eng.submit(p, G) for p in prompts]] == ref
            before = eng.stats()
            first = [s.collect(1)[0][0].token_ids for s in [eng.submit(p, S) for p in prompts]]
            after = eng.stats()
            assert [eng.generate(p, S)[0].token_ids for p in prompts] == first  # seeded: the same bits, any batch
            drafted = after["spec_draft_tokens"] - before["spec_draft_tokens"]
            accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
            assert drafted > 0
            if draft_model is tiny_model:
                assert accepted >= 0.9 * drafted, (accepted, drafted)
            assert eng.stats()["compilations"] == compiled
        finally:
            eng.shutdown()


def test_bad_speculation_settings_are_refused(tiny_model):
    import dataclasses

    tok = Tokenizer.tiny()
    with pytest.raises(ValueError, match="speculative_tokens"):
        Engine(tiny_model, tok, EngineConfig(max_num_seqs=2, max_model_len=128, speculative_tokens=-1))
    with pytest.raises(ValueError, match="speculative method"):
        Engine(tiny_model, tok, EngineConfig(max_num_seqs=2, max_model_len=128, speculative_tokens=2,
                                             speculative_method="eagle"))
    with pytest.raises(ValueError, match="go together"):  # a draft method without its model, and the reverse
        Engine(tiny_model, tok, EngineConfig(max_num_seqs=2, max_model_len=128, speculative_tokens=2,
                                             speculative_method="draft"))
    with pytest.raises(ValueError, match="go together"):
        Engine(tiny_model, tok, EngineConfig(max_num_seqs=2, max_model_len=128, speculative_tokens=2),
               draft_model=tiny_model)
    with pytest.raises(ValueError, match="speculative_tokens >= 1"):
        Engine(tiny_model, tok, EngineConfig(max_num_seqs=2, max_model_len=128, speculative_method="draft"),
               draft_model=tiny_model)
    with pytest.raises(ValueError, match="draft sample method"):
        Engine(tiny_model, tok, EngineConfig(max_num_seqs=2, max_model_len=128, speculative_tokens=2,
                                             speculative_method="draft", draft_sample_method="typical"),
               draft_model=tiny_model)
    with pytest.raises(ValueError, match="needs a draft model"):
        Engine(tiny_model, tok, EngineConfig(max_num_seqs=2, max_model_len=128, speculative_tokens=2,
                                             draft_sample_method="probabilistic"))
    greedy = EngineConfig(max_num_seqs=2, max_model_len=128, speculative_tokens=2, speculative_method="draft")
    shared = Engine(tiny_model, tok, greedy, draft_model=tiny_model).runner  # its verify program takes no q
    with pytest.raises(ValueError, match="draft sample method"):
        Engine(tiny_model, tok, dataclasses.replace(greedy, draft_sample_method="probabilistic"),
               draft_model=tiny_model, runner=shared)
    with pytest.raises(ValueError, match="cost ratio"):
        Engine(tiny_model, tok, EngineConfig(max_num_seqs=2, max_model_len=128, speculative_tokens=2,
                                             speculative_cost=-1.0))
    with pytest.raises(ValueError, match="n-gram sizes"):
        Engine(tiny_model, tok, EngineConfig(max_num_seqs=2, max_model_len=128, speculative_tokens=2,
                                             prompt_lookup_min=3, prompt_lookup_max=2))


def test_server_flags_and_metrics(spec_engine, capsys):
    from kimi_jax.serve.__main__ import build_parser, main
    from kimi_jax.serve.metrics import EngineCollector

    assert main(["--speculative-tokens", "-1"]) == 2 and "--speculative-tokens" in capsys.readouterr().err
    assert main(["--speculative-tokens", "2", "--prompt-lookup-min", "3", "--prompt-lookup-max", "2"]) == 2
    assert "--prompt-lookup-min" in capsys.readouterr().err
    help_text = build_parser().format_help()
    assert "--speculative-tokens" in help_text and "--prompt-lookup-max" in help_text
    assert "--speculative-policy" in help_text and "--speculative-model" in help_text
    assert main(["--speculative-model", "tiny"]) == 2 and "--speculative-tokens" in capsys.readouterr().err
    assert "--draft-sample-method" in help_text
    assert main(["--speculative-tokens", "2", "--draft-sample-method", "probabilistic"]) == 2
    assert "needs --speculative-model" in capsys.readouterr().err
    spec_engine.generate([11, 12, 13] * 3, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                         logit_bias={13: 100.0}))  # some drafts accepted
    families = {f.name: f for f in EngineCollector(spec_engine, "tiny").collect()}
    accepted = families["vllm:spec_decode_num_accepted_tokens"].samples[0].value
    assert accepted == spec_engine.stats()["spec_accepted_tokens"] > 0
