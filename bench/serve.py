"""Serving benchmark: throughput and latency under N concurrent streaming ``openai`` clients, and decode tokens/s
against the bytes-per-step roofline.

    python bench/serve.py                      # CPU: the tiny model served in-process, clients 1, 8, 32
    python bench/serve.py --clients 1,4,16 --max-tokens 64 --prompt-tokens 128
    python bench/serve.py --url http://127.0.0.1:8000 --model tiny    # an already running server
    python bench/serve.py --gpu                # one GPU: `python -m kimi_jax.serve --model kimi-k3.1-reduced` (bf16)
    python bench/serve.py --launch tiny --max-num-seqs 8 --clients 1,8  # the --gpu machinery on CPU, small

Load: each of N clients runs a closed loop of ``--requests-per-client`` streaming /v1/completions requests through
``openai.AsyncOpenAI`` (a prompt of exactly ``--prompt-tokens`` random token ids, ``--max-tokens`` output tokens with
``ignore_eos``, temperature 0.8).  Per request: TTFT = first streamed token - send; TPOT = (last token - first
token) / (completion tokens - 1).  Per level: output tokens/s (all clients' tokens / wall time), requests/s, TTFT and
TPOT p50 / p99.

Decode roofline (whenever the model is known: in-process, --launch, --gpu), per level.  While a level runs, /stats
is polled; the longest stretch in which all of its streams decode and no prefill runs gives the steady-state decode
tokens/s (without one: streams / TPOT p50).  The roofline is the bytes one decode step must move -- every weight it
reads (all non-expert weights, plus the routed experts the batch touches: E·(1 - (1 - k/E)^B) per MoE layer under
uniform routing) plus the cache traffic (KDA state read + written, conv tails, MLA latent rows and index keys read
for the context, the new rows written) -- over the device's best measured copy bandwidth (the max of an XLA copy, an
XLA elementwise pass and a torch copy where torch has CUDA, in a separate process before the server starts).  Bars
(BENCHMARKS.md, end to end): >= 0.70 of the roofline at one stream, >= 0.85 at 32; other levels are reported without
one.

``--gpu`` serves ``kimi-k3.1-reduced`` (kimi_jax/config.py: K3.1 at full width -- hidden 7168, 96 heads of 128,
expert width 3072, latent 3584, top-16 -- 4 layers KDA, KDA, KDA, MLA all MoE, 128 experts instead of 896, vocab
1024) in bf16 with 32 slots, from the real server process (``python -m kimi_jax.serve``), within ~7 minutes on one
H200 including compilation.

Multi-turn (``--scenario multi-turn``): each of N clients holds a conversation of ``--turns`` turns through
/v1/chat/completions (thinking off, ``--max-tokens`` per answer, ``ignore_eos``): one system prompt of about
``--system-tokens`` tokens shared by every conversation, a user message of about ``--user-tokens`` tokens per turn,
each turn resending the history with the previous answers as the server streamed them (the chat template encodes
them again, as a real client's history is).  Per level: TTFT of the first turns and of the later ones, output
tokens/s, the prompt tokens the prefix cache served (``usage.prompt_tokens_details.cached_tokens``).  Run it once as
is and once with ``--server-arg=--no-enable-prefix-caching`` for the comparison (bench/presets.py, ``serve-multiturn``).

    python bench/serve.py --scenario multi-turn                     # CPU, tiny model in-process
    python bench/serve.py --gpu --scenario multi-turn [--server-arg=--no-enable-prefix-caching]

Long context (``--scenario long``): one request at a time with a prompt of each of ``--long-lengths`` random ids (each
k · 4096 + 1 on the GPU: whole 4096-token prefill chunks, the last token through the decode step), ``--max-tokens``
out.  Per length: TTFT, the prefill rate (prompt tokens / TTFT) against its roofline -- the prefill's matmul FLOPs
(2 · active parameters per token, the DSA indexer's L²/2 query-key products and the sparse MLA's top-k attention)
at the bf16 matmul rate measured in the same run -- and the decode TPOT against the bytes-per-step roofline at that
context.  ``--gpu`` serves ``kimi-k3.1-reduced`` with 2 slots, fp8 latents and index keys, positions up to 1.04M.

    python bench/serve.py --gpu --scenario long

Prints the table ``name, shape, ours, peer, ratio, bar, pass/fail`` last; writes the JSON document to ``$OUT``
(serve.json, plus the server log) when set and to ``--json FILE``. Current figures live in docs/performance.md.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import math
import os
import platform
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:  # run as a script from a checkout: import this checkout's kimi_jax
    sys.path.insert(0, str(ROOT))
# decode tokens/s over the bytes-per-step roofline, by streams decoding (BENCHMARKS.md, "end to end"); other
# stream counts are reported without a bar
BARS = {1: 0.70, 32: 0.85}

GPU_DEFAULTS = {  # --gpu: sized to run in one go in < 7 minutes on one H200, compilation included
    "launch": "kimi-k3.1-reduced", "dtype": "bfloat16", "max_num_seqs": 32, "max_model_len": 512,
    # prompts of 129 tokens = one 128-token prefill chunk + the last token through the decode step: one prefill
    # program to compile, and every request prefills the same way
    "prefill_chunk_sizes": "128", "prompt_tokens": 129, "max_tokens": 256, "clients": "1,32",
    "requests_per_client": 1, "startup_timeout": 360,
}


MULTI_TURN_DEFAULTS = {  # --scenario multi-turn, before the --gpu / CPU defaults (explicit options still win)
    "gpu": {"max_num_seqs": 8, "max_model_len": 8192, "prefill_chunk_sizes": "1024,256,64,1", "clients": "1,8",
            "max_tokens": 64, "turns": 4, "system_tokens": 2000, "user_tokens": 100},
    "cpu": {"max_num_seqs": 4, "max_model_len": 2048, "prefill_chunk_sizes": "64,1", "clients": "1,4",
            "max_tokens": 16, "turns": 3, "system_tokens": 600, "user_tokens": 40},
}
LONG_DEFAULTS = {  # --scenario long (explicit options still win)
    "gpu": {"max_num_seqs": 2, "prefill_chunk_sizes": "4096", "max_tokens": 32, "clients": "1",
            "long_lengths": "8193,32769,131073,262145,524289,1040385",
            "server_arg": ["--kv-dtype=fp8", "--index-dtype=fp8", "--no-enable-prefix-caching"]},
    "cpu": {"max_num_seqs": 2, "prefill_chunk_sizes": "256", "max_tokens": 8, "clients": "1",
            "long_lengths": "257,1025,2049", "server_arg": ["--no-enable-prefix-caching"]},
}
WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
         "government company number group problem fact river stone light paper window garden music market").split()


# ================================================================================================== load
async def _one_request(client, model, prompt_ids, max_tokens, seed, on_first=None):
    """One streamed completion: its TTFT, TPOT, end-to-end time and tokens. `on_first()`: called (in a thread)
    when the first token arrives, before the rest is read."""
    t0 = time.perf_counter()
    first = last = None
    usage = None
    stream = await client.completions.create(
        model=model, prompt=prompt_ids, max_tokens=max_tokens, temperature=0.8, seed=seed, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices:
            now = time.perf_counter()
            if first is None and on_first is not None:
                await asyncio.to_thread(on_first)
            first = now if first is None else first
            last = now
    t_end = time.perf_counter()
    n = usage.completion_tokens if usage is not None else 0
    ttft = first - t0 if first is not None else float("nan")
    # tokens may share a chunk (a character split over tokens is held back), so count them from usage
    tpot = (last - first) / (n - 1) if first is not None and n > 1 else float("nan")
    return {"ttft": ttft, "tpot": tpot, "e2e": t_end - t0, "tokens": n}


def get_json(url: str, timeout: float = 30) -> dict:
    """GET a JSON document with the standard library (the GPU host's image carries no httpx; urllib raises
    OSError for connection errors and HTTP errors alike)."""
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def post_json(url: str, timeout: float = 120) -> dict:
    """POST with an empty body; the JSON answer (urllib raises HTTPError, an OSError, on 4xx / 5xx)."""
    req = urllib.request.Request(url, data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


async def trace_steady(base_url: str, running: int, seconds: float) -> dict:
    """Once ``running`` sequences decode and none waits, a device trace of ``seconds`` (the server's
    ``/start_profile`` / ``/stop_profile``; it must run with ``--profile-dir``). Returns the trace directory, the
    seconds traced and the decode steps and prefill chunks the engine ran meanwhile (from /stats)."""
    while True:
        s0 = await asyncio.to_thread(get_json, base_url + "/stats")
        if s0["running_seqs"] >= running and s0["num_requests_waiting"] == 0:
            break
        await asyncio.sleep(0.05)
    started = await asyncio.to_thread(post_json, base_url + "/start_profile")
    cut_short = False
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:  # the level ended first: keep what was traced (never leave a trace running)
        cut_short = True
    s1 = get_json(base_url + "/stats")
    stopped = post_json(base_url + "/stop_profile")
    return {"trace_dir": started["trace_dir"], "seconds": stopped["seconds"], "cut_short": cut_short,
            "steps": s1["num_steps"] - s0["num_steps"],
            "prefill_chunks": s1["num_prefill_chunks"] - s0["num_prefill_chunks"]}


class StatsPoller:
    """Samples GET /stats every `period` seconds while a level runs (engine counters for the decode rate)."""

    def __init__(self, base_url: str, period: float = 0.05):
        self.base_url, self.period, self.samples = base_url, period, []
        self._task = None

    async def _run(self):
        while True:
            try:
                s = await asyncio.to_thread(get_json, self.base_url + "/stats")
                s["t"] = time.perf_counter()
                self.samples.append(s)
            except Exception:  # noqa: BLE001 -- a missed sample only shortens the window
                pass
            await asyncio.sleep(self.period)

    def start(self):
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self):
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass


def _decode_roofline(args, cfg, copy_bw: dict, row: dict, slots: int) -> dict:
    """One level's decode tokens/s against the bytes-per-step roofline of `slots` sequences (module docstring): from
    the level's clean /stats window where it has one, else every slot emitting one token per TPOT p50."""
    samples = row.pop("_samples", None)
    win = decode_window(samples or [], slots)
    if win is not None:
        # mean context over the window: prompt + tokens each sequence has generated by the window's middle
        # (sequences restart after max_tokens when a client sends several requests)
        done = ((win["gen_start"] + win["gen_end"]) / 2 - samples[0]["generation_tokens_total"]) / slots
        context = args.prompt_tokens + done % args.max_tokens
        ours, how = win["tok_s"], f"/stats window {win['seconds']:.1f} s, {win['steps']} steps"
    else:  # no clean window (or counters missing)
        context = args.prompt_tokens + args.max_tokens / 2
        ours, how = slots / (row["tpot_p50_ms"] / 1e3), "slots / TPOT p50"
    nbytes = step_bytes(cfg, args.dtype or "float32", slots, context, kv_itemsize=_kv_itemsize(args),
                        expert_bits=_expert_bits(args))
    bw = copy_bw["gb_s"] * 1e9
    peer = slots / (nbytes["total"] / bw)
    return {"clients": row["clients"], "slots": slots, "decode_tok_s": ours, "measured_by": how, "window": win,
            "context_mean": context, "step_bytes": nbytes, "copy_bandwidth": copy_bw, "roofline_tok_s": peer,
            "roofline_step_ms": 1e3 * nbytes["total"] / bw, "ratio": ours / peer, "bar": BARS.get(slots)}


def decode_window(samples: list, slots: int) -> dict | None:
    """Steady-state decode from /stats samples: the longest run of consecutive samples in which every slot is
    decoding, nothing waits and no prefill chunk runs (a prefill between two samples ends the run).  Returns tokens/s
    and ms per step over it, or None when the counters are missing or no run of two samples exists."""
    keys = ("running_seqs", "num_requests_waiting", "num_prefill_chunks", "num_steps", "generation_tokens_total")
    if not samples or any(k not in samples[0] for k in keys):
        return None
    runs, run = [], []
    for s in samples:
        full = s["running_seqs"] == slots and s["num_requests_waiting"] == 0
        if run and (not full or s["num_prefill_chunks"] != run[-1]["num_prefill_chunks"]):
            runs.append(run)
            run = []
        if full:
            run.append(s)
    runs.append(run)
    runs = [r for r in runs if len(r) >= 2]
    if not runs:
        return None
    best = max(runs, key=lambda r: r[-1]["t"] - r[0]["t"])
    a, b = best[0], best[-1]
    dt, steps = b["t"] - a["t"], b["num_steps"] - a["num_steps"]
    toks = b["generation_tokens_total"] - a["generation_tokens_total"]
    if dt <= 0 or steps <= 0:
        return None
    # the share of those steps dispatched before the previous step's tokens were read (async scheduling)
    overlapped = (b["steps_overlapped"] - a["steps_overlapped"]) / steps if "steps_overlapped" in a else None
    # where the engine's loop spends a step on the host: dispatching it (the jitted call) and blocked reading its
    # tokens; dispatch near step_ms with no wait is a host-bound loop, a long wait a device-bound one
    per_step = lambda key: 1e3 * (b[key] - a[key]) / steps if key in a else None  # noqa: E731
    return {"seconds": dt, "steps": steps, "tokens": toks, "tok_s": toks / dt, "step_ms": 1e3 * dt / steps,
            "overlapped_share": overlapped, "dispatch_ms": per_step("step_dispatch_seconds"),
            "wait_ms": per_step("step_wait_seconds"),
            "gen_start": a["generation_tokens_total"], "gen_end": b["generation_tokens_total"]}


async def run_level(base_url, model, clients, requests_per_client, prompt_tokens, max_tokens, vocab, poll=False,
                    profile=None):
    """One concurrency level. ``profile``: (running sequences, seconds) for a device trace in steady decode."""
    import openai

    rng = np.random.default_rng(clients)
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=900)
    poller = StatsPoller(base_url) if poll else None

    async def worker(w):
        out = []
        for i in range(requests_per_client):
            ids = rng.integers(0, vocab, prompt_tokens).tolist()
            out.append(await _one_request(client, model, ids, max_tokens, seed=w * 1000 + i))
        return out

    if poller:
        poller.start()
    tracer = None if profile is None else asyncio.get_running_loop().create_task(trace_steady(base_url, *profile))
    t0 = time.perf_counter()
    try:
        per = await asyncio.gather(*(worker(w) for w in range(clients)))
    finally:
        wall = time.perf_counter() - t0
        if poller:
            await poller.stop()
        trace = None
        if tracer is not None:
            if not tracer.done():
                tracer.cancel()
            try:
                trace = await tracer
            except asyncio.CancelledError:
                print(f"clients={clients}: the level ended before its slots were all decoding: no trace", flush=True)
        await client.close()
    reqs = [r for p in per for r in p]
    ttft = np.array([r["ttft"] for r in reqs])
    tpot = np.array([r["tpot"] for r in reqs if np.isfinite(r["tpot"])])
    tokens = sum(r["tokens"] for r in reqs)
    pct = lambda a, q: float(np.percentile(a, q)) if len(a) else float("nan")
    row = {"clients": clients, "requests": len(reqs), "wall_s": wall, "output_tok_s": tokens / wall,
           "req_s": len(reqs) / wall, "ttft_p50_ms": 1e3 * pct(ttft, 50), "ttft_p99_ms": 1e3 * pct(ttft, 99),
           "tpot_p50_ms": 1e3 * pct(tpot, 50), "tpot_p99_ms": 1e3 * pct(tpot, 99),
           "e2e_p50_s": pct(np.array([r["e2e"] for r in reqs]), 50)}
    if poller:
        row["_samples"] = poller.samples
    if trace is not None:
        row["trace"] = trace
    return row


def _words_for(base_url: str, model: str, tokens: int, rng) -> str:
    """Random words that the server's tokenizer (POST /tokenize) encodes into about ``tokens`` tokens."""
    def count(text):
        req = urllib.request.Request(base_url + "/tokenize", data=json.dumps({"model": model, "prompt": text})
                                     .encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())["count"]

    n = max(1, tokens // 3)
    text = " ".join(rng.choice(WORDS, n))
    n = max(1, round(n * tokens / max(1, count(text))))
    return " ".join(rng.choice(WORDS, n))


async def run_conversations(base_url, model, clients, turns, system_tokens, user_tokens, max_tokens):
    """``clients`` conversations at once, ``turns`` turns each (see the module docstring); one row of figures."""
    import openai

    rng = np.random.default_rng(1234)  # every level and run sends the same system prompt and user messages
    system = _words_for(base_url, model, system_tokens, rng)
    users = [[_words_for(base_url, model, user_tokens, rng) for _ in range(turns)] for _ in range(clients)]
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=900)

    async def conversation(w):
        messages, out = [{"role": "system", "content": system}], []
        for turn in range(turns):
            messages.append({"role": "user", "content": users[w][turn]})
            t0 = time.perf_counter()
            first, text, usage = None, [], None
            stream = await client.chat.completions.create(
                model=model, messages=messages, max_tokens=max_tokens, temperature=0.8, seed=w * 100 + turn,
                stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True, "chat_template_kwargs": {"thinking": False}})
            async for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                if chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter() if first is None else first
                    text.append(chunk.choices[0].delta.content)
            messages.append({"role": "assistant", "content": "".join(text)})
            details = getattr(usage, "prompt_tokens_details", None)
            out.append({"turn": turn, "ttft": (first or time.perf_counter()) - t0, "tokens": usage.completion_tokens,
                        "prompt_tokens": usage.prompt_tokens,
                        "cached": (getattr(details, "cached_tokens", 0) or 0) if details is not None else 0})
        return out

    t0 = time.perf_counter()
    try:
        per = await asyncio.gather(*(conversation(w) for w in range(clients)))
    finally:
        wall = time.perf_counter() - t0
        await client.close()
    reqs = [r for p in per for r in p]
    p50 = lambda xs: 1e3 * float(np.percentile(xs, 50)) if xs else float("nan")
    prompt = sum(r["prompt_tokens"] for r in reqs)
    cached = sum(r["cached"] for r in reqs)
    return {"clients": clients, "turns": turns, "requests": len(reqs), "wall_s": wall,
            "output_tok_s": sum(r["tokens"] for r in reqs) / wall,
            "ttft_first_turn_p50_ms": p50([r["ttft"] for r in reqs if r["turn"] == 0]),
            "ttft_later_turns_p50_ms": p50([r["ttft"] for r in reqs if r["turn"] > 0]),
            "prompt_tokens": prompt, "cached_tokens": cached, "cached_share": cached / max(prompt, 1),
            "prompt_tokens_last_turn_mean": float(np.mean([r["prompt_tokens"] for r in reqs
                                                           if r["turn"] == turns - 1]))}


# ================================================================================================== roofline
COPY_SNIPPET = r"""
import json, time, jax, jax.numpy as jnp
n = (1 << 30) if jax.devices()[0].platform != "cpu" else (1 << 26)   # bf16 elements: 2 GiB (GPU) / 128 MiB (CPU)
x = jax.random.normal(jax.random.PRNGKey(0), (n,), jnp.float32).astype(jnp.bfloat16)
progs = {"copy": jax.jit(lambda a: jnp.copy(a)), "elementwise": jax.jit(lambda a: a * 2 + 1)}
out = {"device": str(jax.devices()[0]), "bytes": 2 * x.nbytes}
m = 8192 if jax.devices()[0].platform != "cpu" else 1024   # the bf16 matmul rate: the prefill roofline's FLOP rate
a = jax.random.normal(jax.random.PRNGKey(1), (m, m), jnp.float32).astype(jnp.bfloat16)
mm = jax.jit(lambda a: a @ a)
mm(a).block_until_ready()
ts = []
for _ in range(10):
    t = time.perf_counter(); mm(a).block_until_ready(); ts.append(time.perf_counter() - t)
ts.sort()
out["matmul_tflop_s"] = 2 * m ** 3 / ts[len(ts) // 2] / 1e12
del a
for name, f in progs.items():
    y = f(x); y.block_until_ready()
    assert bool(jnp.all(y[:8] == (x[:8] if name == "copy" else x[:8] * 2 + 1)))
    del y
    ts = []
    for _ in range(10):
        t = time.perf_counter(); y = f(x); y.block_until_ready(); ts.append(time.perf_counter() - t); del y
    ts.sort()
    out[name + "_gb_s"] = out["bytes"] / ts[len(ts) // 2] / 1e9
try:  # torch's copy_ where it has CUDA: often above XLA's, and the bars take the best of the two
    import torch
    if torch.cuda.is_available():
        import sys
        sys.path.insert(0, sys.argv[1])  # bench/, for _timing
        from _timing import torch_copy_bandwidth
        out["torch_copy_gb_s"] = torch_copy_bandwidth(out["bytes"] // 2) / 1e9
except ImportError:
    pass
print("COPY_JSON " + json.dumps(out))
"""


def measure_copy_bandwidth(env: dict) -> dict:
    """Device copy bandwidth (read + write bytes / median time), in its own process so that its memory is gone
    before the server starts; returns {'device', 'copy_gb_s', 'elementwise_gb_s', 'torch_copy_gb_s' (where torch has
    CUDA), 'gb_s': the largest}."""
    r = subprocess.run([sys.executable, "-c", COPY_SNIPPET, str(HERE)], env=env, capture_output=True, text=True,
                       timeout=300)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("COPY_JSON ")), None)
    if r.returncode or line is None:
        raise RuntimeError(f"copy-bandwidth probe failed ({r.returncode}): {r.stderr[-2000:]}")
    out = json.loads(line[len("COPY_JSON "):])
    out["gb_s"] = max(out["copy_gb_s"], out["elementwise_gb_s"], out.get("torch_copy_gb_s", 0.0))
    return out


def prefill_flops(cfg, tokens: int) -> dict:
    """Matmul FLOPs of prefilling one prompt of `tokens` tokens: every active weight once per token (2 · active
    parameters, the embedding table aside: it is a lookup), the DSA indexer's query-key scores over every earlier
    position (quadratic), the sparse MLA attention over min(position, topk) keys, and the KDA chunked op (per token
    and head ≈ 8·d² for the state and 4·64·d inside its 64-token chunks)."""
    from kimi_jax.plan import count_params

    counts = count_params(cfg)
    embed = counts["sizes"].get("embed_tokens", 0)
    L = float(tokens)
    linear = 2.0 * (counts["params_active"] - embed) * L
    indexer = attention = kda = 0.0
    for kind in cfg.layer_kinds:
        if kind == "kda":
            H, d = cfg.kda.num_heads, cfg.kda.head_dim
            kda += L * H * (8 * d * d + 4 * 64 * d)
        else:
            m = cfg.mla
            per_key = m.num_heads * (2 * (m.kv_lora_rank + m.qk_rope_head_dim) + 2 * m.kv_lora_rank)
            if cfg.indexer is not None:
                ix = cfg.indexer
                indexer += 2.0 * ix.num_heads * ix.head_dim * L * (L + 1) / 2
                k = min(ix.topk, L)
                attention += per_key * (k * (k + 1) / 2 + k * (L - k))
            else:
                attention += per_key * L * (L + 1) / 2
    total = linear + indexer + attention + kda
    return {"linear": linear, "indexer": indexer, "attention": attention, "kda": kda, "total": total}


def step_bytes(cfg, dtype, batch: int, context: float, kv_itemsize: int | None = None,
               expert_bits: float | None = None) -> dict:
    """Bytes one decode step of `batch` sequences with `context` cached tokens each must move (see the module doc);
    `expert_bits`: bits per routed-expert weight when they are not `dtype` (4.25 for MXFP4).

    From the abstract parameter shapes (nothing is materialised) and the cache layout of the engine: KDA state in
    float32 [B, H, d, d] read and written; q/k/v conv tails [B, K-1, H·d] read and written; MLA latent rows
    (kv_lora_rank + rope) and index keys read for min(context, topk) / context positions and one row each written.
    """
    import jax.numpy as jnp

    from kimi_jax.model import abstract_params

    params = abstract_params(cfg, jnp.dtype(dtype))
    nb = lambda a: int(np.prod(a.shape)) * a.dtype.itemsize
    experts = {k: v for k, v in params.items() if ".block_sparse_moe.experts." in k}
    E, k = cfg.moe.num_experts, cfg.moe.top_k
    touched = E * (1.0 - (1.0 - k / E) ** batch)  # expected distinct experts per MoE layer, uniform routing
    expert_bytes = sum(nb(v) for v in experts.values()) * touched / E
    if expert_bits is not None:
        expert_bytes *= expert_bits / (8 * jnp.dtype(dtype).itemsize)
    embed = params["embed_tokens"]
    dense_bytes = sum(nb(v) for n, v in params.items() if n not in experts and n != "embed_tokens")
    dense_bytes += batch * embed.shape[1] * embed.dtype.itemsize  # only the looked-up rows of the embedding
    act = jnp.dtype(dtype).itemsize
    kv = kv_itemsize or act
    cache = 0.0
    for kind in cfg.layer_kinds:
        if kind == "kda":
            H, d, K = cfg.kda.num_heads, cfg.kda.head_dim, cfg.kda.conv_kernel
            cache += 2 * batch * H * d * d * 4 + 2 * 3 * batch * (K - 1) * H * d * act
        else:
            row = cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim
            di = cfg.indexer.head_dim if cfg.indexer is not None else 0
            attended = min(context, cfg.indexer.topk) if cfg.indexer is not None else context
            cache += batch * (attended * row * kv + context * di * kv + (row + di) * kv)
    return {"weights": dense_bytes + expert_bytes, "dense_weights": dense_bytes, "expert_weights": expert_bytes,
            "experts_touched_per_layer": touched, "cache": cache, "total": dense_bytes + expert_bytes + cache}


# ================================================================================================== server
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LaunchedServer:
    """`python -m kimi_jax.serve` in a subprocess, its log in a file; ready once /health answers 200."""

    def __init__(self, args, env: dict, log_path: Path):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "kimi_jax.serve", "--model", args.launch, "--port", str(self.port),
               "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len),
               "--mesh", args.mesh]
        if args.prefill_chunk_sizes:
            cmd += ["--prefill-chunk-sizes", args.prefill_chunk_sizes]
        if args.dtype:
            cmd += ["--dtype", args.dtype]
        if args.profile:
            cmd += ["--profile-dir", TRACE_ROOT]
        cmd += args.server_arg
        self.cmd = cmd
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]

    def wait_ready(self, timeout: float) -> float:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; log tail:\n{self.tail()}")
            try:  # /health answers 200 with an empty body once the engine runs
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return time.perf_counter() - t0
            except OSError:  # not listening yet, or 503 while it starts
                pass
            time.sleep(0.5)
        raise RuntimeError(f"server not ready after {timeout:.0f} s; log tail:\n{self.tail()}")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


TRACE_ROOT = "/tmp/kimi_jax_traces"  # --profile: where the server writes its traces (large; not under $OUT)


def _summarise_trace(trace: dict, label, out_dir, per: str = "decode step") -> None:
    """Print a trace's summary per decode step (or per `per`: `trace["steps"]` counts them), keep it as
    $OUT/trace_<label>.md and its rows in the level's JSON row (`trace["summary"]`)."""
    import trace_summary

    path = trace_summary.find_trace(trace["trace_dir"])
    steps = max(trace["steps"], 1)
    rows = trace_summary.summarise(trace_summary.load_events(path), top=30, steps=steps)
    cut = " (the level ended first)" if trace["cut_short"] else ""
    what = (f"{trace['steps']} decode steps, {trace['prefill_chunks']} prefill chunks" if per == "decode step" else
            f"{trace['prefill_chunks']} prefill chunks, {trace.get('decode_steps', 0)} decode steps; per {per}")
    unit = " clients" if isinstance(label, int) else ""
    head = f"# {label}{unit}: {trace['seconds']:.1f} s traced{cut}, {what} ({path})"
    text = head + "\n" + trace_summary.render(rows)
    print(text, flush=True)
    trace["summary"] = rows
    if out_dir:
        (out_dir / f"trace_{label}.md").write_text(text + "\n")


# ================================================================================================== report
def _table(rows) -> str:
    cols = [("clients", "{:d}"), ("requests", "{:d}"), ("output_tok_s", "{:.1f}"), ("req_s", "{:.2f}"),
            ("ttft_p50_ms", "{:.0f}"), ("ttft_p99_ms", "{:.0f}"), ("tpot_p50_ms", "{:.1f}"), ("tpot_p99_ms", "{:.1f}"),
            ("e2e_p50_s", "{:.2f}")]
    head = "| " + " | ".join(c for c, _ in cols) + " |"
    sep = "|" + "|".join("---:" for _ in cols) + "|"
    body = ["| " + " | ".join(f.format(r[c]) for c, f in cols) + " |" for r in rows]
    return "\n".join([head, sep] + body)


def _si(x: float) -> str:
    """1.23e10 -> '12.3 G' (bytes and bytes/s in the table)."""
    for unit, f in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= f:
            return f"{x / f:.3g} {unit}"
    return f"{x:.3g} "


def _bar_table(entries) -> str:
    """BENCHMARKS.md's table: name, shape, ours, peer, ratio, bar, pass/fail."""
    head = "| name | shape | ours | peer | ratio | bar | pass/fail |\n|---|---|---:|---:|---:|---:|---|"
    return "\n".join([head] + ["| " + " | ".join(str(x) for x in e) + " |" for e in entries])


def _git_rev() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=HERE, capture_output=True, text=True,
                               timeout=10).stdout.strip()
        return rev + ("+dirty" if dirty else "") if rev else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# ================================================================================================== main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--url", help="benchmark a running server (no roofline: the model is unknown here)")
    src.add_argument("--launch", metavar="PRESET",
                     help="start `python -m kimi_jax.serve --model PRESET` in a subprocess and benchmark it")
    src.add_argument("--gpu", action="store_true",
                     help="the H200 run: --launch kimi-k3.1-reduced --dtype bfloat16 and the settings of GPU_DEFAULTS "
                          "(explicit options still win)")
    p.add_argument("--model", default=None, help="model name to send (default: the preset, else tiny)")
    p.add_argument("--clients", default=None, help="comma-separated concurrency levels (default 1,8,32; --gpu 1,32)")
    p.add_argument("--requests-per-client", type=int, default=None, help="default 4 (--gpu: 1)")
    p.add_argument("--prompt-tokens", type=int, default=None, help="default 64 (--gpu: 129)")
    p.add_argument("--max-tokens", type=int, default=None, help="default 32 (--gpu: 256)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="server cache slots (default 32)")
    p.add_argument("--max-model-len", type=int, default=None, help="server tokens per slot (default 512)")
    p.add_argument("--prefill-chunk-sizes", default=None, help="server prefill chunks (default: the server's; "
                                                               "--gpu: 128)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="server parameter dtype")
    p.add_argument("--mesh", default="1x1", help="--launch: the server's --mesh (default 1x1)")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="--launch: one more argument for the server, e.g. --server-arg=--kv-dtype=fp8 (repeat the "
                        "option for several)")
    p.add_argument("--startup-timeout", type=float, default=None, help="--launch: seconds to wait for /health "
                                                                        "(default 900; --gpu 360)")
    p.add_argument("--prompt-vocab", type=int, default=1000,
                   help="prompts are random ids below this (default 1000: the built-in tokenizer's text ids)")
    p.add_argument("--scenario", choices=["load", "multi-turn", "long"], default="load",
                   help="load (default): independent random prompts; multi-turn: conversations over a shared system "
                        "prompt (the prefix cache's case); long: one prompt at a time of each --long-lengths, TTFT "
                        "and decode TPOT against their rooflines (module docstring)")
    p.add_argument("--long-lengths", default=None,
                   help="long: comma-separated prompt lengths (default 257,1025,2049; --gpu 8K … 1.04M, each "
                        "k·4096 + 1)")
    p.add_argument("--turns", type=int, default=None, help="multi-turn: turns per conversation (default 3; --gpu 4)")
    p.add_argument("--system-tokens", type=int, default=None,
                   help="multi-turn: tokens of the shared system prompt, about (default 600; --gpu 2000)")
    p.add_argument("--user-tokens", type=int, default=None,
                   help="multi-turn: tokens of each user message, about (default 40; --gpu 100)")
    p.add_argument("--profile", type=float, default=None, metavar="S",
                   help="load, --launch / --gpu: in each level, once every slot it fills decodes, a device trace of "
                        "S seconds (the server gets --profile-dir); its summary per decode step "
                        "(bench/trace_summary.py) is printed and written to $OUT/trace_<clients>.md. long: the "
                        "first prompt's prefill and decode are traced in two extra requests (S is ignored), "
                        "summarised per prefill chunk / decode step in $OUT/trace_{prefill,decode}_<tokens>.md")
    p.add_argument("--json", metavar="FILE", help="also write the JSON document to FILE")
    p.add_argument("--xla-flags", default="", metavar="FLAGS",
                   help="--launch / --gpu: appended to the server's XLA_FLAGS (and the copy probe's), e.g. which "
                        "ops XLA's command buffers (CUDA graphs) capture; the JSON document records them")
    p.add_argument("--label", default="", help="suffix of the files written to $OUT (serve_<label>.json, "
                                               "serve_server_<label>.log): several runs in one $OUT")
    return p


def _resolve(args):
    """Fill unset options: --gpu's defaults, then the CPU defaults."""
    if args.scenario == "multi-turn":
        for k, v in MULTI_TURN_DEFAULTS["gpu" if args.gpu else "cpu"].items():
            if getattr(args, k) is None:
                setattr(args, k, v)
    if args.scenario == "long":
        for k, v in LONG_DEFAULTS["gpu" if args.gpu else "cpu"].items():
            if k == "server_arg":
                named = {a.split("=")[0] for a in args.server_arg}
                args.server_arg = args.server_arg + [a for a in v if a.split("=")[0] not in named]
            elif getattr(args, k) is None:
                setattr(args, k, v)
        if args.max_model_len is None:
            args.max_model_len = max(int(x) for x in args.long_lengths.split(",")) + args.max_tokens + 64
        if args.gpu:
            args.startup_timeout = args.startup_timeout or 600
    if args.gpu:
        for k, v in GPU_DEFAULTS.items():
            if getattr(args, k) in (None, False):
                setattr(args, k, v)
    cpu = {"clients": "1,8,32", "requests_per_client": 4, "prompt_tokens": 64, "max_tokens": 32, "max_num_seqs": 32,
           "max_model_len": 512, "startup_timeout": 900}
    for k, v in cpu.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.model is None:
        args.model = args.launch or "tiny"
    return args


def main(argv=None) -> int:
    args = _resolve(build_parser().parse_args(argv))
    levels = [int(x) for x in args.clients.split(",") if x.strip()]
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
    # This process only does host work (HTTP clients, abstract shapes): keep its JAX on the CPU so that it never
    # takes accelerator memory from the server.  The server and the copy probe get the caller's environment.
    child_env = dict(os.environ, PYTHONUNBUFFERED="1")
    child_env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [x for x in child_env.get("PYTHONPATH", "").split(
        os.pathsep) if x])
    if args.xla_flags:
        child_env["XLA_FLAGS"] = " ".join(filter(None, [child_env.get("XLA_FLAGS"), args.xla_flags]))
    if "JAX_PLATFORMS" not in child_env and os.path.exists("/dev/nvidia0"):
        # on a GPU host the server must run on the GPU: a CUDA plugin that fails to start (an XLA flag it rejects)
        # then stops it with the plugin's reason instead of JAX quietly falling back to the CPU
        child_env["JAX_PLATFORMS"] = "cuda"
    if args.profile:
        # traced programs run kernel by kernel: with XLA's command buffers (CUDA graphs) on, the 48B model's step
        # after /stop_profile failed with CUDA_ERROR_LAUNCH_FAILED on an H100 and left the context unusable (as in
        # jax-ml/jax#40260); off, the trace also times each kernel instead of one graph launch
        flags = [child_env.get("XLA_FLAGS"), "--xla_gpu_enable_command_buffer="]
        child_env["XLA_FLAGS"] = " ".join(filter(None, flags))
    os.environ["JAX_PLATFORMS"] = "cpu"
    t_start = time.perf_counter()

    server = engine = launched = None
    setup, copy_bw, cfg = {}, None, None
    if args.url:
        url = args.url.rstrip("/")
    elif args.launch:
        from kimi_jax.config import get_preset

        cfg = get_preset(args.launch)
        print("measuring copy bandwidth ...", flush=True)
        copy_bw = measure_copy_bandwidth(child_env)
        print(f"copy bandwidth on {copy_bw['device']}: copy {copy_bw['copy_gb_s']:.0f} GB/s, elementwise "
              f"{copy_bw['elementwise_gb_s']:.0f} GB/s, torch {copy_bw.get('torch_copy_gb_s', float('nan')):.0f} "
              "GB/s", flush=True)
        log_path = (out_dir or Path("/tmp")) / _labelled("serve_server.log", args)
        launched = LaunchedServer(args, child_env, log_path)
        print(f"starting: {' '.join(launched.cmd)}  (log: {log_path})", flush=True)
        try:
            ready_s = launched.wait_ready(args.startup_timeout)
        except RuntimeError:
            launched.stop()
            raise
        url = launched.url
        setup = {"server_cmd": " ".join(launched.cmd[1:]), "ready_s": round(ready_s, 1),
                 "max_num_seqs": args.max_num_seqs, "max_model_len": args.max_model_len,
                 "dtype": args.dtype or "float32", "device": copy_bw["device"],
                 "xla_flags": child_env.get("XLA_FLAGS", "")}
        print(f"server ready in {ready_s:.0f} s (load + compile)", flush=True)
    else:
        # in-process tiny server on CPU (the original mode of this script)
        import jax

        from kimi_jax.engine import Engine, EngineConfig
        from kimi_jax.serve.app import build_app
        from kimi_jax.serve.server import ServerThread, load_for_serving

        t0 = time.perf_counter()
        model, tok, name = load_for_serving(None, args.model)
        t_load = time.perf_counter() - t0
        cfg = model.config
        kw = {}
        if args.prefill_chunk_sizes:
            kw["prefill_chunk_sizes"] = tuple(int(x) for x in args.prefill_chunk_sizes.split(","))
        kw["prefix_caching"] = "--no-enable-prefix-caching" not in args.server_arg
        engine = Engine(model, tok, EngineConfig(max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                                                 **kw))
        engine.start()
        server = ServerThread(build_app(engine, tok, model_name=name)).start()
        url = server.url
        copy_bw = measure_copy_bandwidth(child_env)
        setup = {"load_s": round(t_load, 1), "compile_s": round(engine.compile_seconds, 1),
                 "device": str(jax.devices()[0]), "max_num_seqs": args.max_num_seqs,
                 "max_model_len": args.max_model_len, "prefill_chunk_sizes": list(engine.runner.chunk_sizes)}
        print(f"in-process server {url}: load {t_load:.1f}s, compile {engine.compile_seconds:.1f}s", flush=True)

    def stop_servers():
        if server is not None:
            server.stop()
        if engine is not None:
            engine.shutdown()
        if launched is not None:
            launched.stop()

    if args.scenario in ("multi-turn", "long"):
        try:
            if args.scenario == "long":
                return _long_context(args, url, cfg, copy_bw, setup, out_dir, t_start)
            return _multi_turn(args, url, levels, setup, out_dir, t_start)
        finally:
            stop_servers()
    try:
        asyncio.run(run_level(url, args.model, 1, 1, args.prompt_tokens, 4, args.prompt_vocab))  # warm-up
        rows = []
        for n in levels:
            profile = (min(n, args.max_num_seqs), args.profile) if args.profile else None
            row = asyncio.run(run_level(url, args.model, n, args.requests_per_client, args.prompt_tokens,
                                        args.max_tokens, args.prompt_vocab, poll=cfg is not None,
                                        profile=profile))
            rows.append(row)
            print(f"clients={n:3d}: {row['output_tok_s']:8.1f} tok/s  TTFT p50 {row['ttft_p50_ms']:7.0f} ms  "
                  f"TPOT p50 {row['tpot_p50_ms']:6.1f} ms", flush=True)
            if "trace" in row:
                _summarise_trace(row["trace"], n, out_dir)
        stats1 = get_json(url + "/stats") if cfg is not None else None
        compiles = (stats1["compilations"] - stats1["compilations_at_start"]) if stats1 else None
    finally:
        stop_servers()

    # ---------------------------------------------------------------------------------------- decode roofline
    rooflines, bar_rows = [], []
    if cfg is not None and copy_bw is not None:
        for r in rows:
            roof = _decode_roofline(args, cfg, copy_bw, r, min(args.max_num_seqs, r["clients"]))
            rooflines.append(roof)
            shape = (f"{args.model} {args.dtype or 'float32'}, B={roof['slots']}, ctx≈{roof['context_mean']:.0f}, "
                     f"{_si(roof['step_bytes']['total'])}B/step @ {_si(copy_bw['gb_s'] * 1e9)}B/s")
            bar = roof["bar"]
            # the bars are GPU bars (BENCHMARKS.md); on a CPU the rows are for information
            verdict = ("info" if bar is None else "pass" if roof["ratio"] >= bar else "FAIL") \
                if "cpu" not in copy_bw["device"].lower() else "info (CPU)"
            bar_rows.append(("decode tok/s vs bytes-per-step roofline", shape, f"{roof['decode_tok_s']:.1f}",
                             f"{roof['roofline_tok_s']:.1f}", f"{roof['ratio']:.2f}",
                             "" if bar is None else f"≥ {bar:.2f}", verdict))
            win = roof["window"] or {}
            if win.get("dispatch_ms") is not None:
                bar_rows.append(("decode step on the host (ms): dispatch / waiting for tokens / step",
                                 f"B={roof['slots']}", f"{win['dispatch_ms']:.2f} / {win['wait_ms']:.2f} / "
                                 f"{win['step_ms']:.2f}", "", "", "", "info"))
    for r in rows:
        shp = f"{r['clients']} clients, prompt {args.prompt_tokens}, {args.max_tokens} out"
        bar_rows += [(f"throughput (output tok/s)", shp, f"{r['output_tok_s']:.1f}", "", "", "", "info"),
                     ("TTFT p50 / p99 (ms)", shp, f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f}", "", "", "",
                      "info"),
                     ("TPOT p50 / p99 (ms)", shp, f"{r['tpot_p50_ms']:.1f} / {r['tpot_p99_ms']:.1f}", "", "", "",
                      "info")]

    import jax

    doc = {"bench": "serve", **_provenance(jax),
           "url": args.url or ("launched" if args.launch else "in-process"), "model": args.model,
           "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
           "requests_per_client": args.requests_per_client, "setup": setup, "compilations_during_run": compiles,
           "levels": rows, "roofline": rooflines[-1] if rooflines else None, "rooflines": rooflines,
           "total_s": round(time.perf_counter() - t_start, 1)}
    table = _table(rows)
    bars = _bar_table(bar_rows)
    _write_doc(doc, args, out_dir, "serve.json")
    print()
    print(table)
    print()
    print(bars)
    return 0


def _kv_itemsize(args):
    """Bytes per cached latent value when the server stores them as fp8 (--server-arg=--kv-dtype=fp8), else None."""
    return 1 if any(a.startswith("--kv-dtype=fp8") for a in args.server_arg) else None


def _expert_bits(args):
    """Bits per routed-expert weight when the launched preset draws them as MXFP4, else None (its dtype)."""
    return 4.25 if any(a.startswith("--random-experts=mxfp4") for a in args.server_arg) else None


def _provenance(jax) -> dict:
    """When, where and with what a figure was measured."""
    return {"date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"), "commit": _git_rev(),
            "host": f"{platform.node()} ({os.cpu_count()} CPUs, {platform.machine()})",
            "versions": f"python {platform.python_version()}, jax {jax.__version__}"}


def _labelled(name: str, args) -> str:
    """`name` with `--label` before its extension (serve.json -> serve_<label>.json)."""
    if not args.label:
        return name
    stem, dot, ext = name.rpartition(".")
    return f"{stem}_{args.label}.{ext}" if dot else f"{name}_{args.label}"


def _write_doc(doc: dict, args, out_dir, name: str) -> None:
    """Print the JSON document and write it to --json and to $OUT/name (labelled by --label)."""
    name = _labelled(name, args)
    text = json.dumps(doc, indent=1, default=float)
    print()
    print(text)
    if args.json:
        Path(args.json).write_text(text, encoding="utf-8")
    if out_dir:
        (out_dir / name).write_text(text, encoding="utf-8")


def _long_context(args, url, cfg, copy_bw, setup, out_dir, t_start) -> int:
    """The long-context scenario against a ready server: one request per prompt length, shortest first."""
    import jax

    lengths = [int(x) for x in args.long_lengths.split(",") if x.strip()]
    kv = _kv_itemsize(args)
    rng = np.random.default_rng(7)
    asyncio.run(run_level(url, args.model, 1, 1, 65, 4, args.prompt_vocab))  # warm-up
    rows = []
    for i, n in enumerate(lengths):
        ids = rng.integers(0, args.prompt_vocab, n).tolist()
        if args.profile and i == 0:  # the shortest prompt traced twice before its measured request
            _trace_long_request(url, args.model, ids, args.max_tokens, n, out_dir)
        r = asyncio.run(_long_request(url, args.model, ids, args.max_tokens))
        flops = prefill_flops(cfg, n - 1) if cfg is not None else None
        row = {"prompt_tokens": n, "ttft_s": r["ttft"], "prefill_tok_s": (n - 1) / r["ttft"],
               "tpot_ms": 1e3 * r["tpot"], "tokens": r["tokens"]}
        if flops is not None and copy_bw is not None:
            rate = copy_bw["matmul_tflop_s"] * 1e12
            row.update(prefill_tflop=flops["total"] / 1e12, prefill_flops=flops,
                       prefill_roofline_s=flops["total"] / rate, prefill_ratio=flops["total"] / rate / r["ttft"])
            nbytes = step_bytes(cfg, args.dtype or "float32", 1, n + args.max_tokens / 2, kv_itemsize=kv,
                                expert_bits=_expert_bits(args))
            row.update(decode_roofline_ms=1e3 * nbytes["total"] / (copy_bw["gb_s"] * 1e9),
                       decode_ratio=nbytes["total"] / (copy_bw["gb_s"] * 1e9) / r["tpot"])
        rows.append(row)
        print(f"{n:8d} tokens: TTFT {r['ttft']:7.2f} s ({row['prefill_tok_s']:8.0f} tok/s"
              + (f", {100 * row['prefill_ratio']:.0f}% of the FLOP roofline" if "prefill_ratio" in row else "")
              + f"), TPOT {row['tpot_ms']:.2f} ms"
              + (f" ({100 * row['decode_ratio']:.0f}% of the bytes roofline)" if "decode_ratio" in row else ""),
              flush=True)
    stats = get_json(url + "/stats")
    doc = {"bench": "serve", "scenario": "long", **_provenance(jax), "model": args.model,
           "max_tokens": args.max_tokens, "setup": setup, "copy_bandwidth": copy_bw, "lengths": rows,
           "compilations_during_run": stats["compilations"] - stats["compilations_at_start"],
           "total_s": round(time.perf_counter() - t_start, 1)}
    _write_doc(doc, args, out_dir, "serve_long.json")
    print()
    bar_rows = []
    for r in rows:
        shape = f"{args.model}, prompt {r['prompt_tokens']:,}"
        bar_rows.append(("TTFT (s) vs prefill FLOP roofline", shape, f"{r['ttft_s']:.2f}",
                         f"{r.get('prefill_roofline_s', float('nan')):.2f}", f"{r.get('prefill_ratio', float('nan')):.2f}",
                         "", "info"))
        bar_rows.append(("decode TPOT (ms) vs bytes roofline", shape, f"{r['tpot_ms']:.2f}",
                         f"{r.get('decode_roofline_ms', float('nan')):.2f}", f"{r.get('decode_ratio', float('nan')):.2f}",
                         "", "info"))
    print(_bar_table(bar_rows))
    return 0


def _trace_long_request(url, model, ids, max_tokens, n, out_dir) -> None:
    """Two device traces of one long prompt: its prefill (a request for one token, traced whole: summarised per
    prefill chunk in $OUT/trace_prefill_<n>.md) and its decode (the same prompt again, traced from the first token to
    the last: per decode step in $OUT/trace_decode_<n>.md)."""
    s0 = get_json(url + "/stats")
    started = post_json(url + "/start_profile")
    asyncio.run(_long_request(url, model, ids, 1))
    s1 = get_json(url + "/stats")
    stopped = post_json(url + "/stop_profile", timeout=600)
    chunks = s1["num_prefill_chunks"] - s0["num_prefill_chunks"]
    _summarise_trace({"trace_dir": started["trace_dir"], "seconds": stopped["seconds"], "cut_short": False,
                      "steps": chunks, "prefill_chunks": chunks, "decode_steps": s1["num_steps"] - s0["num_steps"]},
                     f"prefill_{n}", out_dir, per="prefill chunk")

    marks = {}

    def on_first_token():
        marks["s0"] = get_json(url + "/stats")
        marks["started"] = post_json(url + "/start_profile")

    asyncio.run(_long_request(url, model, ids, max_tokens, on_first=on_first_token))
    s1 = get_json(url + "/stats")
    stopped = post_json(url + "/stop_profile", timeout=600)
    steps = s1["num_steps"] - marks["s0"]["num_steps"]
    _summarise_trace({"trace_dir": marks["started"]["trace_dir"], "seconds": stopped["seconds"], "cut_short": False,
                      "steps": steps, "prefill_chunks": s1["num_prefill_chunks"] - marks["s0"]["num_prefill_chunks"]},
                     f"decode_{n}", out_dir)


async def _long_request(url, model, ids, max_tokens, on_first=None) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=3600)
    try:
        return await _one_request(client, model, ids, max_tokens, seed=0, on_first=on_first)
    finally:
        await client.close()


def _multi_turn(args, url, levels, setup, out_dir, t_start) -> int:
    """The multi-turn scenario against a ready server: a warm-up conversation on other words, then each level."""
    import jax

    caching = "--no-enable-prefix-caching" not in args.server_arg
    asyncio.run(run_conversations(url, args.model, 1, 1, 64, 16, 4))  # warm-up (compiles nothing new: a check)
    rows = []
    for n in levels:
        row = run = asyncio.run(run_conversations(url, args.model, n, args.turns, args.system_tokens,
                                                  args.user_tokens, args.max_tokens))
        rows.append(row)
        print(f"clients={n:3d}: {run['output_tok_s']:8.1f} tok/s  TTFT turn 1 p50 {run['ttft_first_turn_p50_ms']:7.0f} "
              f"ms, later turns {run['ttft_later_turns_p50_ms']:7.0f} ms, cached {100 * run['cached_share']:.0f}% of "
              f"{run['prompt_tokens']} prompt tokens", flush=True)
    stats = get_json(url + "/stats")
    doc = {"bench": "serve", "scenario": "multi-turn", "prefix_caching": caching, **_provenance(jax),
           "model": args.model,
           "turns": args.turns, "system_tokens": args.system_tokens, "user_tokens": args.user_tokens,
           "max_tokens": args.max_tokens, "setup": setup, "levels": rows,
           "compilations_during_run": stats["compilations"] - stats["compilations_at_start"],
           "prefix_cache": {k: v for k, v in stats.items() if k.startswith("prefix_")},
           "total_s": round(time.perf_counter() - t_start, 1)}
    _write_doc(doc, args, out_dir, "serve_multiturn.json" if caching else "serve_multiturn_nocache.json")
    print()
    label = "prefix caching on" if caching else "prefix caching off"
    print(_bar_table([
        (f"TTFT turn 1 / later turns p50 (ms), {label}", f"{r['clients']} clients, {args.turns} turns",
         f"{r['ttft_first_turn_p50_ms']:.0f} / {r['ttft_later_turns_p50_ms']:.0f}", "", "", "", "info")
        for r in rows] + [
        (f"output tok/s, {label}", f"{r['clients']} clients, cached {100 * r['cached_share']:.0f}%",
         f"{r['output_tok_s']:.1f}", "", "", "", "info") for r in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
