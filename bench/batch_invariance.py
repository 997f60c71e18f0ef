"""Batch invariance check on any device: one request alone, then the same request beside N concurrent ones.

    python bench/batch_invariance.py                                    # tiny, float32, CPU
    python bench/batch_invariance.py --model kimi-k3.1-reduced --dtype bf16 --max-num-seqs 32   # a GPU
    python bench/batch_invariance.py --spec 3 --invariant                # speculative, batch-invariant mode

The probe's tokens, sampled-token log-probs and top-5 log-probs must be bit-identical in both runs, for a greedy and
a seeded sampled request; exits 1 on any difference (printing the first one), 0 otherwise.  The crowd mixes prompt
lengths, temperatures, top-k, penalties, n = 1 / 2 and a forced-token guide, and (for --spec) drafts a lot: its
prompts repeat a 6-token pattern.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

HERE = os.path.dirname(os.path.realpath(__file__))
# bench/convert.py would shadow the `convert` package; the repository root goes first instead
sys.path[:] = [os.path.dirname(HERE)] + [p for p in sys.path if os.path.realpath(p or os.curdir) != HERE]


def prompt_ids(seed: int, n: int, vocab: int, repetitive: bool) -> list[int]:
    if repetitive:
        base = prompt_ids(seed, 6, vocab, False)
        return (base * (n // 6 + 1))[:n]
    return [(seed * 7919 + i * 104729) % (min(vocab, 1000) - 3) + 1 for i in range(n)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=256)
    ap.add_argument("--crowd", type=int, default=15)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--spec", type=int, default=0, help="speculative tokens (prompt lookup); 0: off")
    ap.add_argument("--invariant", action="store_true", help="speculative_batch_invariant (with --spec)")
    ap.add_argument("--decode-buckets", default="auto",
                    help="auto (default): 1, 2, 4, … below --max-num-seqs, as the server on an accelerator; none; "
                         "or a list like 1,2,4")
    a = ap.parse_args()

    import jax.numpy as jnp

    import kimi_jax
    from kimi_jax.engine import Engine, EngineConfig, SamplingParams
    from kimi_jax.engine.engine import default_decode_buckets
    from kimi_jax.engine.guide import TokenSequenceGuide
    from kimi_jax.tokenizer import Tokenizer

    from flax import nnx

    from kimi_jax.config import get_preset
    from kimi_jax.model import MAX_RANDOM_PARAMS, Model, param_count
    from kimi_jax.modules.decoder import KimiForCausalLM

    t0 = time.perf_counter()
    dt = jnp.bfloat16 if a.dtype == "bf16" else jnp.float32
    preset = get_preset(a.model)
    if param_count(preset) > MAX_RANDOM_PARAMS:  # e.g. kimi-k3.1-reduced: random weights drawn on the accelerator
        model = Model(KimiForCausalLM(preset, rngs=nnx.Rngs(0), dtype=dt), dt)  # (as the server does for it)
    else:
        model = kimi_jax.load_model(a.model, dtype=dt)
    V = model.config.vocab_size
    buckets = (default_decode_buckets(a.max_num_seqs) if a.decode_buckets == "auto" else ()
               if a.decode_buckets == "none" else tuple(int(b) for b in a.decode_buckets.split(",")))
    cfg = EngineConfig(max_num_seqs=a.max_num_seqs, max_model_len=a.max_model_len, prefill_chunk_sizes=(64, 16),
                       speculative_tokens=a.spec, speculative_batch_invariant=a.invariant, decode_buckets=buckets)
    eng = Engine(model, Tokenizer.tiny(), cfg).start()
    print(f"{a.model} {a.dtype}: engine ready in {time.perf_counter() - t0:.1f}s", flush=True)
    rep = a.spec > 0
    probes = [SamplingParams(max_tokens=a.max_tokens, temperature=0.0, logprobs=True, top_logprobs=5, ignore_eos=True),
              SamplingParams(max_tokens=a.max_tokens, temperature=0.9, top_k=40, seed=7, logprobs=True, top_logprobs=5,
                             ignore_eos=True)]

    def run(prompt, p):
        (o,) = eng.generate(prompt, p)
        return o.token_ids, [(x.token_id, x.logprob, x.top) for x in o.logprobs]

    def crowd_member(i, start):
        start.wait()
        p = SamplingParams(max_tokens=8 + i % 4 * 9, temperature=[0.0, 0.7, 1.2][i % 3], seed=i, top_k=[0, 5][i % 2],
                           logprobs=bool(i % 2), top_logprobs=i % 4, ignore_eos=True, frequency_penalty=0.1 * (i % 3))
        guide = (lambda: TokenSequenceGuide([5, 6, 7, 8])) if i % 5 == 0 else None
        eng.generate(prompt_ids(500 + i, 3 + 11 * i % 90, V, rep), p, n=1 + i % 2, guide_factory=guide)

    failed = False
    try:
        for k, p in enumerate(probes):
            prompt = prompt_ids(101, 40, V, rep)
            alone = run(prompt, p)
            start = threading.Event()
            threads = [threading.Thread(target=crowd_member, args=(i, start), daemon=True) for i in range(a.crowd)]
            for t in threads:
                t.start()
            start.set()
            crowded = run(prompt, p)
            for t in threads:
                t.join(600)
            same = alone == crowded
            print(f"probe {k} ({'greedy' if p.temperature == 0 else 'sampled'}): "
                  f"{'bit-identical' if same else 'DIFFERS'} over {len(alone[0])} tokens", flush=True)
            if not same:
                failed = True
                for j, (x, y) in enumerate(zip(alone[1], crowded[1])):
                    if x != y:
                        print(f"  first difference at token {j}: alone {x[:2]} vs crowd {y[:2]}")
                        break
        s = eng.stats()
        print(f"verify steps {s['spec_verify_steps']}, steps {s['num_steps']} by program width {s['steps_by_rows']}")
    finally:
        eng.shutdown()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
