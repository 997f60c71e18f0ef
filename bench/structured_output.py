"""Host time of grammar-constrained decoding: llguidance vs xgrammar, per step (next-token mask + consuming the token).

    python bench/structured_output.py [--vocab tiny|large|both] [--reps N]

Walks a JSON document that satisfies a schema token by token through each engine's matcher: before each token the
engine computes the allowed-token bitmask (what a structured-output row needs on the host every decode step), then
consumes the token.  ``tiny`` is the built-in 1024-id tokenizer; ``large`` a synthetic 163,840-id byte-level
vocabulary (the Kimi checkpoints' size: 256 bytes + word pieces, punctuation runs, digits and CJK characters drawn
at random) -- no real 160K tokenizer ships with any package here.  Prints grammar compile time and per-step mask
time (mean / p50 / p99 / max, microseconds).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import numpy as np

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "address", "active"],
    "additionalProperties": False,
}
DOC = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", "engines", "poetry"],
       "address": {"city": "London", "zip": "W1"}, "active": True}


def synthetic_ranks(n: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    ranks = {bytes([b]): b for b in range(256)}
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    syll = [a + b for a in letters for b in "aeiouy"] + list(letters)
    punct = list(' ,.;:!?"\'()[]{}<>-_=+*/\\|@#$%^&~`\n\t')
    cjk = [chr(c) for c in range(0x4E00, 0x4E00 + 6000)]
    while len(ranks) < n:
        r = rng.random()
        if r < 0.6:
            w = "".join(rng.choice(syll) for _ in range(rng.randint(1, 4)))
            w = (" " if rng.random() < 0.6 else "") + (w.capitalize() if rng.random() < 0.2 else w)
        elif r < 0.75:
            w = "".join(rng.choice(punct) for _ in range(rng.randint(2, 4)))
        elif r < 0.85:
            w = "".join(rng.choice("0123456789") for _ in range(rng.randint(2, 3)))
        else:
            w = "".join(rng.choice(cjk) for _ in range(rng.randint(1, 2)))
        b = w.encode()
        if b not in ranks:
            ranks[b] = len(ranks)
    return ranks


def tokenizers(which: str):
    from kimi_jax.tokenizer import Tokenizer, special_token_map

    out = {}
    if which in ("tiny", "both"):
        out["tiny (1,024 ids)"] = Tokenizer.tiny()
    if which in ("large", "both"):
        ranks = synthetic_ranks(163584)
        out["synthetic 163,840 ids"] = Tokenizer(ranks, special_token_map("k3", len(ranks)))
    return out


def summary(ts):
    us = sorted(t * 1e6 for t in ts)
    return (f"mean {statistics.mean(us):7.1f}  p50 {us[len(us) // 2]:7.1f}  p99 {us[int(len(us) * 0.99)]:7.1f}  "
            f"max {us[-1]:7.1f} us over {len(us)} steps")


def bench_llguidance(tok, ids, reps):
    import llguidance
    import llguidance.numpy as lln

    t0 = time.perf_counter()
    llt = llguidance.LLTokenizer.from_tiktoken(encoder=tok.encoding._mergeable_ranks,  # noqa: SLF001
                                               special_tokens=tok.special_tokens, pattern=tok.pat_str,
                                               eos_token=tok.eos_id, n_vocab=tok.vocab_size)
    t_tok = time.perf_counter() - t0
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    mask = lln.allocate_token_bitmask(1, tok.vocab_size)
    steps, compiles = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        m = llguidance.LLMatcher(llt, grammar)
        compiles.append(time.perf_counter() - t0)
        for t in ids:
            t0 = time.perf_counter()
            lln.fill_next_token_bitmask(m, mask)
            steps.append(time.perf_counter() - t0)
            assert (mask[0, t // 32] >> (t % 32)) & 1, "the document's token is masked"
            assert m.consume_token(t), m.get_error()
        assert not m.is_error()
    return t_tok, compiles, steps


def bench_xgrammar(tok, ids, reps):
    import xgrammar as xgr

    vocab = [tok.token_bytes(i) for i in range(tok.vocab_size)]
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=tok.vocab_size, stop_token_ids=[tok.eos_id])
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    t_tok = time.perf_counter() - t0
    mask = np.zeros(xgr.get_bitmask_shape(1, tok.vocab_size), np.int32)
    steps, compiles = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        cg = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
        m = xgr.GrammarMatcher(cg)
        compiles.append(time.perf_counter() - t0)
        for t in ids:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(mask)
            steps.append(time.perf_counter() - t0)
            assert (mask[0, t // 32] >> (t % 32)) & 1, "the document's token is masked"
            assert m.accept_token(t)
    return t_tok, compiles, steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", default="both", choices=("tiny", "large", "both"))
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    text = json.dumps(DOC, separators=(",", ":"))
    for name, tok in tokenizers(a.vocab).items():
        ids = tok.encode(text)
        print(f"== {name}: {len(ids)} tokens of {text!r}")
        for eng, fn in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
            t_tok, compiles, steps = fn(tok, ids, a.reps)
            print(f"  {eng:10s} tokenizer setup {t_tok * 1e3:8.1f} ms; grammar {statistics.median(compiles) * 1e3:7.1f}"
                  f" ms (median); mask {summary(steps)}")


if __name__ == "__main__":
    main()
