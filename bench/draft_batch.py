"""The draft model's proposal time: every sequence in one batch (``DraftModelProposer.propose_batch``, what the
engine runs) against one sequence per call (a proposer of one row), in one process, on one model.

    python bench/draft_batch.py                 # CPU: the tiny model (fp32), 4 sequences, k = 4

Each timed step is one proposal for every sequence, resumed as the engine resumes it: the target kept the first two
drafts and emitted a token of its own. The drafts of both ways are checked equal (float32). Prints ms per step
(median of ``--rounds`` rounds of ``--steps`` steps, the two ways interleaved) and the table
``name, shape, ours, peer, ratio, bar, pass/fail`` (no bar in BENCHMARKS.md: "info").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--sequences", type=int, default=4)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)

    import jax

    from kimi_jax.engine.draft_model import DraftModelProposer, DraftRequest
    from kimi_jax import load_model

    model = load_model(args.preset)
    S, K = args.sequences, args.k
    max_len = args.prompt_tokens + 3 * (args.rounds * args.steps + 1) + K + 1  # each step adds 3 tokens
    batched = DraftModelProposer(model, K, max_len, rows=S)
    alone = DraftModelProposer(model, K, max_len)
    batched.warmup()
    alone.warmup()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, min(model.config.vocab_size, 1000), args.prompt_tokens).tolist() for _ in range(S)]

    def one_batch(ctx):
        return batched.propose_batch([DraftRequest(i, c, K) for i, c in enumerate(ctx)])

    def one_at_a_time(ctx):
        return [alone.propose(i, c, K) for i, c in enumerate(ctx)]

    contexts = {"batched": [list(p) for p in prompts], "alone": [list(p) for p in prompts]}
    ways = {"batched": one_batch, "alone": one_at_a_time}
    times = {name: [] for name in ways}
    for name, fn in ways.items():  # the prompts' feed: not timed
        drafts = fn(contexts[name])
        contexts[name] = [c + d[:2] + [5] for c, d in zip(contexts[name], drafts)]
    for _ in range(args.rounds):
        for name, fn in ways.items():
            t = time.perf_counter()
            for _ in range(args.steps):
                drafts = fn(contexts[name])
                contexts[name] = [c + d[:2] + [5] for c, d in zip(contexts[name], drafts)]
            times[name].append((time.perf_counter() - t) / args.steps * 1e3)
    if contexts["batched"] != contexts["alone"]:
        print("ERROR: batched drafts differ from drafting one sequence at a time", flush=True)
        return 1
    ms = {name: statistics.median(v) for name, v in times.items()}
    print(f"# {args.preset} on {jax.devices()[0].device_kind}, jax {jax.__version__}: {S} sequences, k = {K}; "
          f"ms per proposal step, rounds {times}", flush=True)
    print("\nname, shape, ours, peer, ratio, bar, pass/fail")
    print(f"draft proposal batched vs one at a time, {S} seq k={K}, {ms['batched']:.1f} ms, {ms['alone']:.1f} ms, "
          f"{ms['alone'] / ms['batched']:.2f}, info, -")
    return 0


if __name__ == "__main__":
    sys.exit(main())
