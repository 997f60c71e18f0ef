"""Serving benchmark: throughput and latency under N concurrent streaming clients.

    python bench/serve.py                          # starts the tiny model in-process (CPU), clients 1, 8, 32
    python bench/serve.py --clients 1,4,16 --max-tokens 64 --prompt-tokens 128
    python bench/serve.py --url http://127.0.0.1:8000 --model tiny   # an already running server

Each of N clients runs a closed loop of ``--requests-per-client`` streaming /v1/completions requests (prompt of
exactly ``--prompt-tokens`` token ids, ``--max-tokens`` output tokens with ``ignore_eos``, temperature 0.8).  Per
request: TTFT = first streamed chunk - send; TPOT = (last token - first token) / (tokens - 1); E2E.  Per level:
output tokens/s (all clients' tokens / wall time), requests/s, TTFT and TPOT p50 / p99.

Prints a table and a JSON document, and appends a dated entry to bench/RESULTS.md (created with a header when
missing; entries are only ever appended).  ``--no-results`` skips the file.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS.md"
HEADER = """# Benchmark results

Dated entries appended by the scripts in bench/ (newest last). Each entry names the script, the commit, the machine
and the exact settings; numbers are only comparable within one machine.
"""


async def _one_request(client, url, model, prompt_ids, max_tokens, seed):
    body = {"model": model, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0.8, "seed": seed,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    token_times, usage = [], None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if obj.get("usage"):
                usage = obj["usage"]
            for ch in obj.get("choices", []):
                if ch.get("finish_reason") is None:
                    token_times.append(time.perf_counter())
    t_end = time.perf_counter()
    n = usage["completion_tokens"] if usage else len(token_times)
    ttft = token_times[0] - t0 if token_times else float("nan")
    tpot = (token_times[-1] - token_times[0]) / (len(token_times) - 1) if len(token_times) > 1 else float("nan")
    return {"ttft": ttft, "tpot": tpot, "e2e": t_end - t0, "tokens": n}


async def run_level(url, model, clients, requests_per_client, prompt_tokens, max_tokens, vocab):
    import httpx

    rng = np.random.default_rng(clients)
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def worker(w):
            out = []
            for i in range(requests_per_client):
                ids = rng.integers(0, vocab, prompt_tokens).tolist()
                out.append(await _one_request(client, url, model, ids, max_tokens, seed=w * 1000 + i))
            return out

        t0 = time.perf_counter()
        per = await asyncio.gather(*(worker(w) for w in range(clients)))
        wall = time.perf_counter() - t0
    reqs = [r for p in per for r in p]
    ttft = np.array([r["ttft"] for r in reqs])
    tpot = np.array([r["tpot"] for r in reqs if np.isfinite(r["tpot"])])
    tokens = sum(r["tokens"] for r in reqs)
    pct = lambda a, q: float(np.percentile(a, q)) if len(a) else float("nan")
    return {"clients": clients, "requests": len(reqs), "wall_s": wall, "output_tok_s": tokens / wall,
            "req_s": len(reqs) / wall, "ttft_p50_ms": 1e3 * pct(ttft, 50), "ttft_p99_ms": 1e3 * pct(ttft, 99),
            "tpot_p50_ms": 1e3 * pct(tpot, 50), "tpot_p99_ms": 1e3 * pct(tpot, 99),
            "e2e_p50_s": pct(np.array([r["e2e"] for r in reqs]), 50)}


def _table(rows) -> str:
    cols = [("clients", "{:d}"), ("requests", "{:d}"), ("output_tok_s", "{:.1f}"), ("req_s", "{:.2f}"),
            ("ttft_p50_ms", "{:.0f}"), ("ttft_p99_ms", "{:.0f}"), ("tpot_p50_ms", "{:.1f}"), ("tpot_p99_ms", "{:.1f}"),
            ("e2e_p50_s", "{:.2f}")]
    head = "| " + " | ".join(c for c, _ in cols) + " |"
    sep = "|" + "|".join("---:" for _ in cols) + "|"
    body = ["| " + " | ".join(f.format(r[c]) for c, f in cols) + " |" for r in rows]
    return "\n".join([head, sep] + body)


def _git_rev() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=HERE, capture_output=True, text=True,
                               timeout=10).stdout.strip()
        return rev + ("+dirty" if dirty else "") if rev else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def append_results(entry: str) -> None:
    """Append only: never rewrite what others wrote (the header is written once, when the file is missing)."""
    new = not RESULTS.exists()
    with open(RESULTS, "a", encoding="utf-8") as f:
        if new:
            f.write(HEADER)
        f.write("\n" + entry.rstrip() + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="benchmark a running server (default: start the tiny model in-process)")
    p.add_argument("--model", default="tiny", help="model name to send (default tiny)")
    p.add_argument("--clients", default="1,8,32", help="comma-separated concurrency levels (default 1,8,32)")
    p.add_argument("--requests-per-client", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=32, help="in-process server: cache slots (default 32)")
    p.add_argument("--max-model-len", type=int, default=512, help="in-process server: tokens per slot (default 512)")
    p.add_argument("--prompt-vocab", type=int, default=1000,
                   help="with --url: prompts are random ids below this (default 1000, the tiny model's text ids)")
    p.add_argument("--json", metavar="FILE", help="also write the JSON document to FILE")
    p.add_argument("--no-results", action="store_true", help="do not append to bench/RESULTS.md")
    args = p.parse_args(argv)
    levels = [int(x) for x in args.clients.split(",") if x.strip()]

    server = engine = None
    setup = {}
    if args.url:
        url, vocab = args.url.rstrip("/"), args.prompt_vocab
    else:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        import jax

        from kimi_jax.engine import Engine, EngineConfig
        from kimi_jax.serve.app import build_app
        from kimi_jax.serve.server import ServerThread, load_for_serving

        t0 = time.perf_counter()
        model, tok, name = load_for_serving(None, args.model)
        t_load = time.perf_counter() - t0
        engine = Engine(model, tok, EngineConfig(max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len))
        engine.start()
        server = ServerThread(build_app(engine, tok, model_name=name)).start()
        url, vocab = server.url, tok.num_ranks
        setup = {"load_s": round(t_load, 1), "compile_s": round(engine.compile_seconds, 1),
                 "device": str(jax.devices()[0]), "max_num_seqs": args.max_num_seqs,
                 "max_model_len": args.max_model_len, "prefill_chunk_sizes": list(engine.runner.chunk_sizes)}
        print(f"in-process server {url}: load {t_load:.1f}s, compile {engine.compile_seconds:.1f}s", flush=True)

    try:
        asyncio.run(run_level(url, args.model, 1, 1, args.prompt_tokens, 4, vocab))  # warm-up
        rows = []
        for n in levels:
            row = asyncio.run(run_level(url, args.model, n, args.requests_per_client, args.prompt_tokens,
                                        args.max_tokens, vocab))
            rows.append(row)
            print(f"clients={n:3d}: {row['output_tok_s']:8.1f} tok/s  TTFT p50 {row['ttft_p50_ms']:7.0f} ms  "
                  f"TPOT p50 {row['tpot_p50_ms']:6.1f} ms", flush=True)
        compiles = engine.stats()["compilations"] - engine.stats()["compilations_at_start"] if engine else None
    finally:
        if server is not None:
            server.stop()
        if engine is not None:
            engine.shutdown()

    doc = {"bench": "serve", "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
           "commit": _git_rev(), "host": f"{platform.node()} ({os.cpu_count()} CPUs, {platform.machine()})",
           "url": args.url or "in-process", "model": args.model, "prompt_tokens": args.prompt_tokens,
           "max_tokens": args.max_tokens, "requests_per_client": args.requests_per_client, "setup": setup,
           "compilations_during_run": compiles, "levels": rows}
    table = _table(rows)
    print()
    print(table)
    print()
    print(json.dumps(doc, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1), encoding="utf-8")
    if not args.no_results:
        settings = (f"model `{args.model}` ({doc['url']}), prompt {args.prompt_tokens} tokens, {args.max_tokens} "
                    f"output tokens (ignore_eos, temperature 0.8), {args.requests_per_client} requests per client")
        if setup:
            settings += (f"; {setup['max_num_seqs']} slots x {setup['max_model_len']} tokens, prefill chunks "
                         f"{setup['prefill_chunk_sizes']}, device {setup['device']}, load {setup['load_s']} s, "
                         f"compile {setup['compile_s']} s, compilations while serving: {compiles}")
        entry = (f"## {doc['date'][:10]} bench/serve.py (commit {doc['commit']})\n\n"
                 f"Host: {doc['host']}. Settings: {settings}.\n\n{table}\n")
        append_results(entry)
        print(f"appended to {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
