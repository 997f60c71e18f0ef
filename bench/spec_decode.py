"""Speculative decoding (docs/model.md §12): output tokens/s of the engine with prompt-lookup drafts against the same
engine decoding one token per step, in one process, on one model.

    python bench/spec_decode.py                 # CPU: the tiny model (fp32), 4 slots
    python bench/spec_decode.py --gpu           # one GPU: kimi-k3.1-reduced in bf16 (K3.1 at full width, 4 layers)

One engine with ``speculative_tokens = k`` serves every run; its proposer is swapped between runs (``None`` runs the
one-token ``step`` program, the baseline), and so is its policy: ``always`` verifies whenever a row drafts (what the
mechanism costs and gives), ``adaptive`` is the engine's default (``engine/spec_policy.py``: verify only when the
drafts are expected to pay for the wider step, from each sequence's acceptance so far and the measured time ratio).
Scenarios, each at 1 and at ``--max-num-seqs`` concurrent requests (greedy, ``ignore_eos``, ``--max-tokens`` each):

* ``repeat`` -- a logit bias makes every output one token repeated: prompt lookup drafts hit from the third token
  on, so this is the mechanism's best case (tokens per verify step near k + 1);
* ``reject`` -- a proposer that drafts k tokens the model never takes: every step is a verify step that emits one
  token, the worst case (what a useless draft costs);
* ``natural`` -- random prompts through the n-gram proposer on random weights: drafts are rare, so this is the
  cost of looking (host-side lookups, the occasional verify step);
* ``draft`` (not in the default set) -- a draft model drafts (``engine/draft_model.py``, its greedy continuation):
  ``--draft-model same`` (default) is the target itself, every draft kept in float32 -- the mechanism's ceiling
  with the draft's own forward passes paid; a preset name drafts with that preset's random weights (same vocabulary);
* ``draft-sampled`` (not in the default set) -- the same draft model with ``draft_sample_method`` probabilistic:
  a sampled request (``--temperature`` > 0) draws its drafts from the draft's q and the target keeps each with
  min(1, p/q). Compare with ``draft`` at the same temperature, whose greedy drafts are kept with probability p(d).
  With it in the set the engine is built with the draft model (its verify program takes q, zeros for the other
  scenarios' drafts);
* ``noise`` (not in the default set) -- no speculation at all: the ``natural`` prompts decoded twice, the second
  time in reverse order (other slots, other neighbours), to see how much a row's bf16 numerics depend on its batch;
* ``chunks`` (not in the default set) -- no speculation either: prompts 64 tokens longer, prefilled in a 64-token
  chunk by the engine and one token at a time by a second engine, the rounding difference the engine already has
  between two shapes of the same computation (compare with ``natural``'s in bf16).

Per run: output tokens/s (all requests' tokens / wall time), verify steps, drafts proposed / accepted, and the ratio
to the baseline of the same scenario and concurrency.  ``--temperature`` (default 0, greedy) samples every request
instead (seeded); sampled outputs follow the model's distribution but are not compared token by token.  Greedy
runs' outputs are compared with the baseline's:
in float32 they must be equal (else the bench stops); in bf16 a row's logits computed inside a ``[B, k+1]`` verify
forward round differently from the one-token step's, so near-ties can flip and the run reports how many outputs
are identical and where the first difference is.  Prints the table ``name, shape, ours, peer, ratio, bar, pass/fail``
last
(no bar in BENCHMARKS.md: "info"); writes spec_decode.json to ``$OUT`` when set.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


class WrongProposer:
    """Drafts k tokens that differ from the biased output token: always rejected."""

    def __init__(self, k: int, avoid: int, vocab: int):
        self.k, self.avoid, self.vocab = k, avoid, vocab

    def propose(self, seq_id, tokens, max_tokens):
        t = (self.avoid + 1) % self.vocab
        return [t] * min(self.k, max_tokens)

    def forget(self, seq_id):
        pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", action="store_true", help="kimi-k3.1-reduced in bf16, 32 slots (default: tiny on CPU)")
    ap.add_argument("--preset", default=None)
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    ap.add_argument("--k", type=int, default=4, help="drafts per verify step (default 4)")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="slots (default 4 on CPU, 32 with --gpu)")
    ap.add_argument("--max-tokens", type=int, default=None, help="output tokens per request (CPU 48, GPU 128)")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--scenarios", default="repeat,reject,natural")
    ap.add_argument("--draft-model", default="same", metavar="same|PRESET",
                    help="the draft scenario's draft model: the target itself (default) or a preset (random weights)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="every request's temperature (default 0: greedy, outputs compared with the baseline)")
    args = ap.parse_args(argv)

    import jax

    from kimi_jax.engine import Engine, EngineConfig, SamplingParams
    from kimi_jax.engine.spec_policy import SpecPolicy
    from kimi_jax.serve.server import load_for_serving

    preset = args.preset or ("kimi-k3.1-reduced" if args.gpu else "tiny")
    dtype = args.dtype or ("bfloat16" if args.gpu else "float32")
    B = args.max_num_seqs or (32 if args.gpu else 4)
    max_tokens = args.max_tokens or (128 if args.gpu else 48)
    K = args.k
    t0 = time.perf_counter()
    # the server's loader: random weights beyond load_model's cap when they fit the device (kimi-k3.1-reduced)
    model, tok, _ = load_for_serving(preset=preset, dtype=dtype)
    V = model.config.vocab_size
    print(f"# {preset} {dtype} on {jax.devices()[0].device_kind}: loaded in {time.perf_counter() - t0:.1f}s",
          flush=True)
    chunks = (64, 1) if args.prompt_tokens < 256 else (256, 64, 1)
    scenarios = args.scenarios.split(",")
    draft = None
    if "draft" in scenarios or "draft-sampled" in scenarios:
        from kimi_jax.serve.server import load_draft_model

        draft = model if args.draft_model == "same" else load_draft_model(args.draft_model, dtype=dtype)
    sampled = "draft-sampled" in scenarios  # the engine's verify program then takes the drafts' q
    engine = Engine(model, tok, EngineConfig(max_num_seqs=B, max_model_len=args.prompt_tokens + max_tokens + 64,
                                             prefill_chunk_sizes=chunks, speculative_tokens=K,
                                             speculative_method="draft" if sampled else "ngram",
                                             draft_sample_method="probabilistic" if sampled else "greedy",
                                             parallel_compile=args.gpu), draft_model=draft if sampled else None)
    t0 = time.perf_counter()
    engine.start()
    print(f"# engine: {B} slots, k = {K}, compiled in {time.perf_counter() - t0:.1f}s", flush=True)
    if sampled:
        from kimi_jax.engine.ngram import NgramProposer

        sampled_proposer = engine.proposer
        ngram = NgramProposer(K, engine.config.prompt_lookup_min, engine.config.prompt_lookup_max)
    else:
        ngram = engine.proposer
    always = SpecPolicy(adaptive=False)
    adaptive = engine.spec_policy  # the engine's default: adaptive, cost measured as it runs
    rng = np.random.default_rng(0)
    biased = 13 % V

    def workload(scenario, n):
        T = args.prompt_tokens + (64 if scenario == "chunks" else 0)  # "chunks": long enough for a 64-token chunk
        prompts = [rng.integers(0, min(V, 1000), T).tolist() for _ in range(n)]
        bias = {biased: 100.0} if scenario in ("repeat", "reject") else {}
        return prompts, SamplingParams(max_tokens=max_tokens, temperature=args.temperature, seed=0, ignore_eos=True,
                                       logit_bias=bias, logprobs=True, top_logprobs=2)

    def run(proposer, prompts, params, policy=None):
        engine.proposer = proposer
        if policy is not None:
            engine.spec_policy = policy
        s0 = engine.stats()
        t = time.perf_counter()
        streams = [engine.submit(p, params) for p in prompts]
        seqs = [s.collect(1)[0][0] for s in streams]
        wall = time.perf_counter() - t
        s1 = engine.stats()
        d = lambda key: s1[key] - s0[key]
        outs = [q.token_ids for q in seqs]
        lps = [q.logprobs for q in seqs]
        return outs, lps, dict(seconds=wall, tokens=sum(map(len, outs)), tok_per_s=sum(map(len, outs)) / wall,
                          steps=d("num_steps"), verify_steps=d("spec_verify_steps"),
                          drafted=d("spec_draft_tokens"), accepted=d("spec_accepted_tokens"))

    # warm-up: every program once (prefill, step, verify)
    wp, wparams = workload("repeat", 2)
    run(None, wp, wparams)
    run(ngram, wp, wparams, always)

    def compare(base_out, base_lps, out, lps):
        """How far two runs' greedy outputs agree: identical rows, the first differing token of each, the
        baseline's top-2 log-prob gap where they part (a near-tie when rounding flipped it) and how far the chosen
        tokens' log-probs moved on the common prefix."""
        same = [a == b for a, b in zip(out, base_out)]
        first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(out, base_out)]
        gaps = [lp[i].top[0][1] - lp[i].top[1][1] for lp, i, ok in zip(base_lps, first, same) if not ok]
        drift = max((abs(a.logprob - b.logprob) for la, lb, i in zip(base_lps, lps, first)
                     for a, b in zip(la[:i], lb[:i])), default=0.0)
        text = "" if all(same) else (
            f"; {sum(same)}/{len(same)} outputs identical, the others from token {min(first)} on (median "
            f"{int(np.median([f for f, ok in zip(first, same) if not ok]))}); top-2 gap at the split: median "
            f"{np.median(gaps):.3f}, max {max(gaps):.3f} nats; chosen log-prob drift before it <= {drift:.3f}")
        return all(same), text, dict(identical_outputs=sum(same), first_difference=min(first), split_gaps=gaps,
                                     logprob_drift=drift)

    chunks_engine = draft_proposer = None
    rows, doc = [], {"preset": preset, "dtype": dtype, "device": jax.devices()[0].device_kind, "slots": B, "k": K,
                     "max_tokens": max_tokens, "prompt_tokens": args.prompt_tokens, "runs": []}
    for scenario in scenarios:
        for n in (1, B):
            prompts, params = workload(scenario, n)
            base_out, base_lps, base = run(None, prompts, params)
            if scenario == "noise":  # no speculation: the same prompts again, in reverse order (other slots)
                out, lps, again = run(None, prompts[::-1], params)
                _, text, agreement = compare(base_out, base_lps, out[::-1], lps[::-1])
                print(f"noise    x {n:3d}: one-token decoding, the same prompts in reverse order{text or ': identical'}",
                      flush=True)
                doc["runs"].append(dict(scenario=scenario, requests=n, baseline=base, again=again, **agreement))
                continue
            if scenario == "chunks":  # no speculation: a second engine prefills the prompts one token at a time
                if chunks_engine is None:
                    chunks_engine = Engine(model, tok, dataclasses.replace(engine.config, prefill_chunk_sizes=(1,),
                                                                           speculative_tokens=0)).start()
                seqs = [s.collect(1)[0][0] for s in [chunks_engine.submit(p, params) for p in prompts]]
                _, text, agreement = compare(base_out, base_lps, [q.token_ids for q in seqs],
                                             [q.logprobs for q in seqs])
                print(f"chunks   x {n:3d}: one-token decoding, prompts prefilled in chunks of 1 instead of 64"
                      f"{text or ': identical'}", flush=True)
                doc["runs"].append(dict(scenario=scenario, requests=n, baseline=base, **agreement))
                continue
            if scenario == "draft":
                if draft_proposer is None:
                    from kimi_jax.engine.draft_model import DraftModelProposer

                    draft_proposer = DraftModelProposer(draft, K, engine.max_model_len + K, vocab_size=V,
                                                        rows=engine.B)
                    draft_proposer.warmup()
                proposer = draft_proposer
            elif scenario == "draft-sampled":
                proposer = sampled_proposer
            else:
                proposer = ngram if scenario != "reject" else WrongProposer(K, biased, V)
            for name, policy in (("always", always), ("adaptive", adaptive)):
                spec_out, spec_lps, spec = run(proposer, prompts, params, policy)
                identical, agree, agreement = compare(base_out, base_lps, spec_out, spec_lps)
                if args.temperature > 0:  # sampled: the same distribution, not the same tokens
                    identical, agree = True, ""
                if not identical and dtype == "float32":
                    print(f"ERROR: {scenario} x {n}: speculative output differs from the baseline{agree}", flush=True)
                    return 1
                ratio = spec["tok_per_s"] / base["tok_per_s"]
                acc = spec["accepted"] / max(spec["drafted"], 1)
                print(f"{scenario:13s} x {n:3d} {name:8s}: baseline {base['tok_per_s']:8.1f} tok/s ({base['steps']} "
                      f"steps), speculative {spec['tok_per_s']:8.1f} tok/s ({spec['steps']} steps, "
                      f"{spec['verify_steps']} verify, {spec['accepted']}/{spec['drafted']} drafts kept = {acc:.2f}) "
                      f"-> {ratio:.2f}x{agree}", flush=True)
                doc["runs"].append(dict(scenario=scenario, requests=n, policy=name, baseline=base, speculative=spec,
                                        ratio=ratio, cost_ratio=policy.cost(n), **agreement))
                rows.append((f"spec decode {scenario} ({name})", f"{n} req x {max_tokens} tok, k={K}",
                             f"{spec['tok_per_s']:.1f} tok/s", f"{base['tok_per_s']:.1f}", f"{ratio:.2f}", "info",
                             "-"))
        print(f"# the adaptive policy's verify / step time ratio now: {adaptive.cost(1):.2f} at 1 row, "
              f"{adaptive.cost(B):.2f} at {B}", flush=True)
    engine.shutdown()
    if chunks_engine is not None:
        chunks_engine.shutdown()
    print("\nname, shape, ours, peer, ratio, bar, pass/fail")
    for r in rows:
        print(", ".join(r))
    out = os.environ.get("OUT")
    if out:
        Path(out, "spec_decode.json").write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
