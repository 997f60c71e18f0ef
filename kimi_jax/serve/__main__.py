"""`python -m kimi_jax.serve`: the OpenAI-compatible server (see ``--help``)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import sys
import time

from sharding.mesh import (AXES, FAKE_DEVICES_FLAG, distributed_process, fake_cpu_devices, initialize_distributed,
                           make_mesh, parse_mesh_spec)

from .. import __version__
from ..config import PRESETS
from ..engine import Engine, EngineConfig
from ..engine.engine import DEFAULT_TOKEN_SPLIT_MIN_TOKENS, default_decode_buckets
from ..engine.runner import resolve_kv_dtype
from ..kernels import ATTENTION_PRECISIONS, KernelConfig, attention_precision
from .lifecycle import DEFAULT_SHUTDOWN_TIMEOUT_S, Drain, run_server
from .limits import DEFAULT_MAX_QUEUED_REQUESTS, DEFAULT_MAX_REQUEST_BYTES

DESCRIPTION = """\
Serve a kimi_jax model over an OpenAI-compatible HTTP API.

Without --checkpoint it serves the built-in `tiny` preset (Kimi K3.1 architecture, every feature on, random
weights from --seed, the built-in 1024-id tokenizer) -- enough to exercise the whole stack on a laptop CPU.

Endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, POST /tokenize, POST /detokenize,
GET /health (503 once the engine died, while it recovers from a failed step, and while shutting down),
GET /metrics (Prometheus, vLLM metric names), GET /stats (engine JSON).  Limits and safety (request size, queue,
image URLs, shutdown): docs/serving.md.

The engine batches up to --max-num-seqs sequences in fixed cache slots of --max-model-len tokens each and runs one
compiled decode step for all of them; prompts are prefilled in chunks of --prefill-chunk-sizes tokens.  Every XLA
program is compiled once at start-up (logged); serving never compiles again.
"""

EPILOG = """\
examples:
  python -m kimi_jax.serve                                  # tiny model on 127.0.0.1:8000
  python -m kimi_jax.serve --port 9000 --max-num-seqs 8 --max-model-len 1024 --api-key sk-local
  python -m kimi_jax.serve --checkpoint /ckpt/kimi-linear   # a converted or Hugging Face checkpoint dir
  python -m kimi_jax.serve --mesh 2x1 --fake-cpu-devices    # tiny model split 2 ways over 2 faked CPU devices
  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}'

--mesh AxB is A-way model parallel x B-way data parallel over A*B devices (the named forms of sharding.mesh, e.g.
model=4,data=2, work too).  Parameters are placed by sharding/rules.py (KDA / MLA heads, routed experts and the
vocabulary split over the model axis); KDA states split by heads, and with --dcp N the MLA pages split N ways
(docs/serving.md "Sharded serving").  With fewer than A*B devices the server stops with an error naming the fix, on
a CPU-only machine:
      XLA_FLAGS=--xla_force_host_platform_device_count=N python -m kimi_jax.serve --mesh ...
or --fake-cpu-devices, which does the same from inside (JAX's CPU device count set to A*B before its backend
starts; logged).
Several processes (a TPU pod slice, GPU hosts, or two CPU processes here): run the same command on every process
with --coordinator-address / --num-processes / --process-id (or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
JAX_PROCESS_ID; --distributed on a TPU pod); --mesh spans the devices of all of them.  Process 0 listens and
schedules; the others run the same programs on their devices.  For example, 2 processes x 4 faked CPU devices:
  python -m kimi_jax.serve --mesh 8x1 --dcp 8 --fake-cpu-devices --coordinator-address 127.0.0.1:8476 \\
      --num-processes 2 --process-id 0 &          # and the same with --process-id 1
"""

log = logging.getLogger("kimi_jax.serve")
DEFAULT_COMPILATION_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "kimi_jax", "jax_cache")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kimi_jax.serve", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", metavar="DIR",
                     help="a converted kimi_jax checkpoint or a Hugging Face checkpoint directory (with tiktoken.model)")
    src.add_argument("--model", metavar="PRESET", default=None,
                     help=f"a preset with random weights (default: tiny); presets: {', '.join(sorted(PRESETS))} "
                          "(the full-size ones are too large to materialise; serve checkpoints for them)")
    p.add_argument("--mesh", default="1x1", metavar="AxB",
                   help="device mesh: A-way model parallel x B-way data parallel over A*B devices (default 1x1). "
                        "Too few devices: an error naming XLA_FLAGS=--xla_force_host_platform_device_count=N "
                        "(see below), unless --fake-cpu-devices")
    p.add_argument("--fake-cpu-devices", action="store_true",
                   help="on a CPU-only machine with fewer devices than --mesh needs, fake them (JAX's CPU device "
                        "count, the same as XLA_FLAGS=--xla_force_host_platform_device_count=N); a count set in "
                        "XLA_FLAGS wins")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=_port, default=8000,
                   help="TCP port, 0–65535 (default 8000; 0: any free port). Checked free before the model loads")
    p.add_argument("--max-num-seqs", type=int, default=32, metavar="N",
                   help="cache slots = sequences decoded together in one step (default 32)")
    p.add_argument("--max-model-len", type=int, default=None, metavar="N",
                   help="tokens per sequence, prompt + output (default: min(model's max_position_embeddings, 2048)); "
                        "longer prompts get a 400")
    p.add_argument("--kv-dtype", default="auto", choices=["auto", "bf16", "fp32", "fp8", "nvfp4"],
                   help="storage format of the paged MLA latent cache: auto = the model's dtype (default); bf16; fp32; "
                        "fp8 (576 B/token/layer); nvfp4 (352 B/token/layer). Rows are quantised on write and "
                        "dequantised inside the attention ops")
    p.add_argument("--index-dtype", default=None, choices=["bf16", "fp32", "fp8", "mxfp4"],
                   help="storage format of the DSA index keys (default: the latent's for fp32 / bf16 latents, else "
                        "fp8 = 132 B/token/layer; mxfp4 = 68 B needs index keys a multiple of 32 wide)")
    p.add_argument("--dcp", type=int, default=1, metavar="N",
                   help="decode context parallelism: split every sequence's cached MLA tokens N ways, round-robin, "
                        "over the mesh's tensor axis (N = its size, as vLLM's DCP inside the TP group) or a context "
                        "axis of size N (named --mesh form); each device then holds 1/N of the pages "
                        "(default 1: the pools whole on every device)")
    p.add_argument("--token-split-min-tokens", type=int, default=DEFAULT_TOKEN_SPLIT_MIN_TOKENS, metavar="N",
                   help="with --dcp N over a context axis (named --mesh form, e.g. expert=8,tensor=1,context=8 "
                        "--dcp 8): prefill chunk sizes of at least N tokens run split by tokens over that axis, "
                        "each device 1/dcp of the chunk, instead of every device running all of it (default "
                        f"{DEFAULT_TOKEN_SPLIT_MIN_TOKENS}; 0 = never).  Such chunk sizes must be multiples of "
                        "--dcp.  /stats counts token_split_prefill_tokens")
    p.add_argument("--num-blocks", type=int, default=None, metavar="N",
                   help="pages of 64 tokens per MLA cache pool, the null page included (default: enough for every "
                        "slot at --max-model-len; the prefix cache keeps what the running sequences leave free). "
                        "Fewer pages than that overcommit: when they run out, cached prefixes are evicted first, then "
                        "the youngest sequence is preempted and recomputed later")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="parameter / activation dtype (default: float32 for presets, the checkpoint's otherwise)")
    p.add_argument("--attention-precision", default="auto", choices=ATTENTION_PRECISIONS,
                   help="the MLA attention's products (the model's DSA / dense paged ops, KernelConfig."
                        "dsa_precision): exact (float32 products against the cache), storage (bf16 operands with "
                        "float32 accumulation on the tensor cores / MXU, within the quantised formats' 5e-3 bar; "
                        "what a bf16 model runs in transformers or vLLM), or auto (default): storage when the "
                        "model runs in bfloat16, exact in float32")
    p.add_argument("--kernels", default="", metavar="FAMILY=BACKEND,...",
                   help="the implementation of op families, e.g. 'norm=reference,moe=reference' (KernelConfig: kda, "
                        "moe, dsa, norm; each auto | reference | gpu | tpu | ...; default auto: the platform's "
                        "kernels where they apply). For taking one kernel family out, e.g. to measure what it buys")
    p.add_argument("--api-key", default=os.environ.get("KIMI_JAX_API_KEY"), metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize "
                        "(default: $KIMI_JAX_API_KEY, else no key)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="model id in the API (default: the preset name or the checkpoint path)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights of a preset (default 0)")
    p.add_argument("--random-experts", choices=["dense", "mxfp4"], default="dense",
                   help="a preset's random routed experts: dense in --dtype (default), or drawn directly as MXFP4 "
                        "(4.25 bits a weight, the MXFP4 kernels; no dense copy is ever made), which is what puts a "
                        "real-size model such as kimi-linear-48b on one 80 GB GPU")
    p.add_argument("--prefill-chunk-sizes", default="64,1", metavar="C1,C2,...",
                   help="prefill chunk sizes, one compiled program each (default 64,1); a prompt is run in the "
                        "largest chunks that fit, a remainder smaller than every size rides the decode steps.  KDA "
                        "pads each call to whole 64-token blocks, so use multiples of 64 plus 1 (on accelerators "
                        "e.g. 1024,256,64,1)")
    p.add_argument("--decode-buckets", default="auto", metavar="auto|none|B1,B2,...",
                   help="decode step programs over fewer slots than --max-num-seqs, so that a step with few "
                        "sequences running computes few rows (vLLM's batch sizes): auto (default) = 1, 2, 4, … below "
                        "--max-num-seqs on an accelerator, none on CPU; none = every step over all slots (the same "
                        "arithmetic for a row whatever the load: docs/serving.md, Batch invariance); or a list")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="overlap decode steps (vLLM's async scheduling): in plain decoding the next step is dispatched "
                        "before this one's tokens are read, so reading them, detokenizing and building the next "
                        "inputs run while the device computes; the same tokens as one step at a time (default: on "
                        "an accelerator, in one process or several; off on CPU. Speculative decoding and guided rows "
                        "step one at a time)")
    p.add_argument("--plain-sampling", action=argparse.BooleanOptionalAction, default=None,
                   help="also compile every decode program without the sampler's two branches (top-k / top-p / "
                        "min-p filter, top log-probs) and run it while no running request uses either: on a GPU "
                        "each branch makes the host wait for the device once a step. The same tokens either way "
                        "(default: on for a GPU, off elsewhere; it doubles the decode programs compiled at start)")
    p.add_argument("--prefill-token-budget", type=int, default=256, metavar="N",
                   help="prompt tokens prefilled between two decode steps while sequences are running (default 256)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the cache of earlier requests whose ids start the same (on by default; "
                        "--no-enable-prefix-caching turns it off): their pages are shared, and a prompt resumes from "
                        "the deepest KDA checkpoint on its ids -- system prompts, tool definitions, documents, the "
                        "conversation so far (a finished answer is cached too).  usage.prompt_tokens_details."
                        "cached_tokens says how many prompt tokens came from it (docs/serving.md, Prefix caching)")
    p.add_argument("--prefix-cache-checkpoints", type=int, default=None, metavar="N",
                   help="KDA state checkpoints the prefix cache holds at most, least recently used dropped first; "
                        "each costs one sequence's KDA state (/stats prefix_checkpoint_bytes_per_device; default: "
                        "--max-num-seqs, at least 8)")
    p.add_argument("--prefix-checkpoint-pages", type=int, default=None, metavar="N",
                   help="take a checkpoint every N pages of a prefill (besides where a prompt leaves the cached "
                        "pages and where it ends); default: by memory cost, the fewest pages (a power of two) that "
                        "cost as much as one checkpoint")
    p.add_argument("--speculative-tokens", type=int, default=0, metavar="K",
                   help="speculative decoding (default 0 = off): draft up to K tokens per sequence by prompt lookup "
                        "(the latest earlier occurrence of its last n tokens) and verify them in one step; the output "
                        "distribution is the model's own.  Pays where outputs repeat their context (code, quotes, "
                        "structured text) and in forced tool calls (what the guide forces is drafted outright); "
                        "--speculative-model drafts with a smaller model instead")
    p.add_argument("--speculative-model", default=None, metavar="DIR_OR_PRESET",
                   help="draft the speculative tokens with this smaller model instead of prompt lookup: a checkpoint "
                        "directory or a preset (random weights, --seed) over the served model's vocabulary; needs "
                        "--speculative-tokens K.  The output distribution stays the served model's own "
                        "(--draft-sample-method)")
    p.add_argument("--draft-sample-method", choices=["greedy", "probabilistic"], default="greedy",
                   help="how --speculative-model drafts (docs/model.md §12): greedy (default) drafts its argmax, "
                        "verified as prompt-lookup drafts are (kept with probability p(draft)); probabilistic samples "
                        "a sampled "
                        "request's drafts from the draft model's distribution q at the request's temperature and "
                        "keeps each with probability min(1, p/q), which keeps more drafts when the two models agree; "
                        "greedy requests draft greedily either way")
    p.add_argument("--speculative-policy", choices=["adaptive", "always"], default="adaptive",
                   help="adaptive (default): verify drafts only when they are expected to pay for the wider step, "
                        "from each sequence's acceptance so far and the measured step times; always: whenever a "
                        "sequence has drafts")
    p.add_argument("--prompt-lookup-min", type=int, default=2, metavar="N",
                   help="shortest n-gram the speculative prompt lookup matches (default 2)")
    p.add_argument("--prompt-lookup-max", type=int, default=4, metavar="N",
                   help="longest n-gram the speculative prompt lookup tries first (default 4)")
    p.add_argument("--guided-string-max-tokens", type=int, default=256, metavar="N",
                   help="with tool_choice 'required' or a named tool, cap each string argument at N tokens in case the "
                        "model never closes it (default 256)")
    p.add_argument("--no-image-fetch", action="store_true",
                   help="refuse http(s) image URLs in chat requests (data: URLs only): the server then never fetches "
                        "a URL on a client's behalf")
    p.add_argument("--vision-warmup", action="store_true",
                   help="compile the vision tower for every image size bucket at start, in the background (serving "
                        "starts at once; without it each bucket compiles the first time an image needs it, while "
                        "that request waits)")
    p.add_argument("--vision-batch-images", type=int, default=16, metavar="N",
                   help="run the vision tower for the images of several waiting requests in one call, up to N "
                        "images (their runs overlap on the device; 1: each request's images alone; default 16)")
    p.add_argument("--image-fetch-timeout", type=float, default=10.0, metavar="S",
                   help="seconds allowed for fetching one http(s) image URL (default 10)")
    p.add_argument("--allow-private-image-urls", action="store_true",
                   help="fetch image URLs whose host resolves to a loopback, private, link-local, multicast or "
                        "reserved address (refused by default, after DNS and on every redirect, so that a client "
                        "cannot make the server reach its own network); for trusted deployments only")
    multi = p.add_argument_group(
        "several processes (docs/serving.md): the same command on every process; process 0 listens")
    multi.add_argument("--coordinator-address", metavar="HOST:PORT", default=None,
                       help="process 0's address for jax.distributed (default: $JAX_COORDINATOR_ADDRESS); giving "
                            "one makes this a multi-process launch")
    multi.add_argument("--num-processes", type=int, default=None, metavar="N",
                       help="processes in the launch (default: $JAX_NUM_PROCESSES, or what JAX detects)")
    multi.add_argument("--process-id", type=int, default=None, metavar="I",
                       help="this process's index, 0 … N-1 (default: $JAX_PROCESS_ID, or what JAX detects)")
    multi.add_argument("--distributed", action="store_true",
                       help="initialise jax.distributed with what JAX detects by itself (TPU pod slices, SLURM, "
                            "Open MPI), without a coordinator address")
    multi.add_argument("--heartbeat-timeout", type=int, default=30, metavar="S",
                       help="a process silent for S seconds stops every other one with a non-zero exit (JAX's "
                            "coordination service), so a dead peer never leaves the server hanging (default 30)")
    limits = p.add_argument_group("limits and safety (docs/serving.md)")
    limits.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES, metavar="N",
                        help="largest request body in bytes; larger ones get a 413 before they are read "
                             f"(default {DEFAULT_MAX_REQUEST_BYTES} = 32 MiB; 0: no limit)")
    limits.add_argument("--max-queued-requests", type=int, default=DEFAULT_MAX_QUEUED_REQUESTS, metavar="N",
                        help="requests that may wait for the engine (queued or prefilling); beyond that new ones "
                             f"get a 429 with Retry-After (default {DEFAULT_MAX_QUEUED_REQUESTS}; 0: no limit)")
    limits.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S, metavar="S",
                        help="on SIGTERM / Ctrl-C stop accepting and let running requests finish for up to S "
                             "seconds; those still running then end with an error (a stream: an error chunk and "
                             f"[DONE]); a second signal stops at once (default {DEFAULT_SHUTDOWN_TIMEOUT_S:g})")
    p.add_argument("--compilation-cache", metavar="DIR",
                   default=os.environ.get("KIMI_JAX_COMPILATION_CACHE", DEFAULT_COMPILATION_CACHE),
                   help="JAX persistent compilation cache: restarts load compiled programs instead of compiling "
                        "again (default: $KIMI_JAX_COMPILATION_CACHE, else ~/.cache/kimi_jax/jax_cache; 'none' "
                        "turns it off)")
    p.add_argument("--profile-dir", metavar="DIR", default=None,
                   help="enable POST /start_profile and /stop_profile (behind the API key): a jax.profiler trace "
                        "of everything the server runs in between -- XLA programs, GPU / TPU kernels, host "
                        "threads -- into a new directory under DIR (TensorBoard profile and Perfetto trace; "
                        "docs/serving.md). Off by default")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="log level (default info)")
    return p


def mesh_device_count(text: str) -> int:
    """Devices a `--mesh` spec needs (AxB or a named form of `sharding.mesh`); ValueError when malformed."""
    sizes = parse_mesh_spec(text)  # MeshError is a ValueError; its message shows the accepted forms (AxB, ...)
    return math.prod(sizes[a] for a in AXES)


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 0–65535, got {port}")
    return port


def parse_decode_buckets(text: str, max_num_seqs: int):
    """``--decode-buckets``: "auto", () for "none", or the listed row counts (each in [1, max_num_seqs))."""
    text = text.strip().lower()
    if text in ("auto", "none"):
        return "auto" if text == "auto" else ()
    try:
        sizes = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise ValueError(f"expected auto, none or row counts like 1,2,4,8; got {text!r}") from None
    if not sizes or not 1 <= sizes[0] <= sizes[-1] < max_num_seqs:
        raise ValueError(f"row counts must lie in [1, --max-num-seqs={max_num_seqs}), got {text!r}")
    return sizes


def cannot_listen(host: str, port: int) -> str | None:
    """Why the server could not listen on (host, port) — a bad address, a port in use — or None. Checked before the
    model loads (minutes for a real checkpoint) rather than found by uvicorn after it; the probe socket is closed
    again, with SO_REUSEADDR as uvicorn binds."""
    import socket

    if port == 0:
        return None
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        return f"--host {host}: {e.strerror or e}"
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(addr)
        except OSError as e:
            return f"cannot listen on {host}:{port}: {e.strerror or e}"
    return None


def _fail(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


def main(argv=None, *, auto_devices: bool = False) -> int:
    """Run the server; returns the exit status (2: bad arguments or a model that cannot be served).

    ``auto_devices``: allowed to change the process's JAX CPU device count (``--fake-cpu-devices``).  Only the
    command line (``python -m kimi_jax.serve``), which owns its process, passes True; a ``main([...])`` call inside a
    larger program never changes that program's JAX settings.
    """
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:  # refused before any model is loaded
        KernelConfig().replaced(args.kernels)
    except ValueError as e:
        return _fail(f"--kernels: {e}")
    try:
        need = mesh_device_count(args.mesh)
    except ValueError as e:
        return _fail(str(e))
    try:
        chunk_sizes = tuple(int(x) for x in args.prefill_chunk_sizes.split(",") if x.strip())
    except ValueError as e:
        return _fail(f"--prefill-chunk-sizes: {e}")
    if args.max_num_seqs < 1:
        return _fail("--max-num-seqs must be at least 1")
    try:
        buckets = parse_decode_buckets(args.decode_buckets, args.max_num_seqs)
    except ValueError as e:
        return _fail(f"--decode-buckets: {e}")
    if args.token_split_min_tokens < 0:
        return _fail(f"--token-split-min-tokens must be 0 (no token-split prefill) or more, got "
                     f"{args.token_split_min_tokens}")
    if args.speculative_tokens < 0:
        return _fail(f"--speculative-tokens must be 0 (off) or more, got {args.speculative_tokens}")
    if args.speculative_model and args.speculative_tokens < 1:
        return _fail("--speculative-model needs --speculative-tokens K >= 1 (the drafts per verify step)")
    if args.draft_sample_method != "greedy" and not args.speculative_model:
        return _fail(f"--draft-sample-method {args.draft_sample_method} needs --speculative-model (prompt lookup "
                     "drafts are deterministic)")
    if not 1 <= args.prompt_lookup_min <= args.prompt_lookup_max:
        return _fail(f"--prompt-lookup-min / --prompt-lookup-max must satisfy 1 <= min <= max, got "
                     f"{args.prompt_lookup_min} / {args.prompt_lookup_max}")
    if args.vision_batch_images < 1:
        return _fail(f"--vision-batch-images must be at least 1, got {args.vision_batch_images}")
    if not 0 < args.image_fetch_timeout < float("inf"):
        return _fail(f"--image-fetch-timeout must be a positive number of seconds, got {args.image_fetch_timeout}")
    if args.max_request_bytes < 0:
        return _fail(f"--max-request-bytes must be 0 (no limit) or more, got {args.max_request_bytes}")
    if args.max_queued_requests < 0:
        return _fail(f"--max-queued-requests must be 0 (no limit) or more, got {args.max_queued_requests}")
    if not 0 <= args.shutdown_timeout < float("inf"):
        return _fail(f"--shutdown-timeout must be 0 or more seconds, got {args.shutdown_timeout}")
    if args.heartbeat_timeout < 1:
        return _fail(f"--heartbeat-timeout must be at least 1 second, got {args.heartbeat_timeout}")
    try:
        resolve_kv_dtype(args.kv_dtype)
    except ValueError as e:
        return _fail(f"--kv-dtype: {e}")

    # Everything that configures JAX's backends comes before the first device query: multi-process initialisation,
    # then the fake CPU device count (per process).
    try:
        initialize_distributed(args.coordinator_address, args.num_processes, args.process_id,
                               auto=args.distributed, heartbeat_timeout_s=args.heartbeat_timeout)
    except (ValueError, RuntimeError) as e:
        return _fail(f"cannot start jax.distributed: {e}")
    rank, processes = distributed_process()
    if processes > 1:
        log.info("jax.distributed initialised: process %d of %d", rank, processes)
    leader = rank == 0
    if processes > 1 and args.speculative_model:
        return _fail("--speculative-model is not served across processes (the draft model runs on process 0's "
                     "first device); use prompt lookup drafts (--speculative-tokens alone)")
    if processes > 1 and need % processes:
        return _fail(f"--mesh {args.mesh} ({need} devices) does not divide over {processes} processes")
    busy = cannot_listen(args.host, args.port) if leader else None  # only process 0 listens
    if busy:
        return _fail(busy)
    per_process = need // processes
    faked = auto_devices and args.fake_cpu_devices and per_process > 1 and fake_cpu_devices(per_process)

    import jax

    devices = jax.devices()
    platform = devices[0].platform
    if faked and platform == "cpu":
        log.info("--mesh %s: faked %d CPU devices (--fake-cpu-devices: jax_num_cpu_devices=%d, the same as "
                 "XLA_FLAGS=%s=%d)", args.mesh, jax.local_device_count(), per_process, FAKE_DEVICES_FLAG,
                 per_process)
    if need > len(devices):
        hint = ""
        if platform == "cpu" and args.fake_cpu_devices and FAKE_DEVICES_FLAG in os.environ.get("XLA_FLAGS", ""):
            # the flag was given but a count in XLA_FLAGS wins: suggesting the flag again would not help
            hint = (f" --fake-cpu-devices leaves the CPU device count that XLA_FLAGS sets "
                    f"({os.environ['XLA_FLAGS']!r}); set {FAKE_DEVICES_FLAG}={need} there or unset it")
        elif platform == "cpu":
            hint = (f" On a CPU-only machine you can fake devices: XLA_FLAGS={FAKE_DEVICES_FLAG}={per_process} "
                    f"python -m kimi_jax.serve --mesh {args.mesh} ..., or add --fake-cpu-devices")
        return _fail(f"--mesh {args.mesh} needs {need} devices but only {len(devices)} {platform} device(s) are "
                     f"visible.{hint}")
    mesh = None
    if need > 1:
        mesh = make_mesh(args.mesh, devices)
    if args.dcp != 1:
        sizes = parse_mesh_spec(args.mesh)
        if args.dcp < 1 or args.dcp not in (sizes["model"], sizes["context"]):
            return _fail(f"--dcp {args.dcp} must equal the mesh's tensor size ({sizes['model']}) or its context size "
                         f"({sizes['context']}); --mesh {args.mesh}")
    if args.compilation_cache and args.compilation_cache.lower() != "none":
        jax.config.update("jax_compilation_cache_dir", args.compilation_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
        log.info("persistent compilation cache: %s", args.compilation_cache)
    where = (f"mesh {args.mesh} = {dict(mesh.shape)} over {mesh.devices.size} devices" if mesh is not None
             else f"{devices[0]} (mesh 1x1)")
    log.info("kimi_jax %s, JAX %s: %d %s device(s) visible, using %s", __version__, jax.__version__,
             len(devices), platform, where)

    # imported here, not above: FastAPI (the app) and Orbax (the loader) would add ~0.4 s to `--help`
    from .app import build_app
    from .server import load_for_serving

    if args.checkpoint and args.random_experts != "dense":
        return _fail("--random-experts is for a preset's random weights; a --checkpoint's experts are its own")
    what = args.checkpoint or f"preset {args.model or 'tiny'} (random weights, seed {args.seed})"
    log.info("loading %s ...", what)
    t0 = time.perf_counter()
    try:
        model, tokenizer, name = load_for_serving(args.checkpoint, args.model, dtype=args.dtype, seed=args.seed,
                                                  mesh=mesh, max_model_len=args.max_model_len,
                                                  random_experts=args.random_experts)
    except (ValueError, FileNotFoundError, OSError, ImportError) as e:
        return _fail(f"cannot load {what}: {e}")
    cfg = model.config
    log.info("loaded %s (%s, %d layers, vocab %d) in %.1fs; tokenizer %s", what, cfg.architecture, cfg.num_layers,
             cfg.vocab_size, time.perf_counter() - t0, tokenizer)
    precision = attention_precision(args.attention_precision, model.dtype)
    if args.kernels:
        model = model.with_kernels(model.kernels.replaced(args.kernels))
        log.info("kernels: %s (--kernels %s)", model.kernels, args.kernels)
    if precision != model.kernels.dsa_precision:
        model = model.with_kernels(dataclasses.replace(model.kernels, dsa_precision=precision))
    log.info("attention products at %s precision (--attention-precision %s, %s model)", precision,
             args.attention_precision, getattr(model.dtype, "__name__", str(model.dtype)))
    max_len = args.max_model_len if args.max_model_len is not None else min(cfg.max_position_embeddings, 2048)
    draft = None
    if args.speculative_model:
        from .server import load_draft_model

        try:
            draft = load_draft_model(args.speculative_model, dtype=args.dtype, seed=args.seed)
        except (ValueError, FileNotFoundError, OSError, ImportError) as e:
            return _fail(f"cannot load the draft model {args.speculative_model}: {e}")
        log.info("draft model %s: %s, %d layers, vocab %d", args.speculative_model, draft.config.architecture,
                 draft.config.num_layers, draft.config.vocab_size)
    mirror = None
    if processes > 1:
        from ..engine.multihost import Channel, Mirror

        mirror = Mirror(Channel.from_jax())
    try:
        engine = Engine(model, tokenizer, EngineConfig(
            max_num_seqs=args.max_num_seqs, max_model_len=max_len, prefill_chunk_sizes=chunk_sizes,
            prefill_token_budget=args.prefill_token_budget, kv_dtype=args.kv_dtype, index_dtype=args.index_dtype,
            num_blocks=args.num_blocks, dcp=args.dcp, token_split_min_tokens=args.token_split_min_tokens,
            decode_buckets=(default_decode_buckets(args.max_num_seqs, mesh.shape["data"] if mesh is not None else 1)
                            if buckets == "auto" and platform != "cpu" else () if buckets == "auto" else buckets),
            async_scheduling=args.async_scheduling, plain_sampling=args.plain_sampling,
            prefix_caching=args.enable_prefix_caching, prefix_checkpoints=args.prefix_cache_checkpoints,
            prefix_checkpoint_blocks=args.prefix_checkpoint_pages, vision_warmup=args.vision_warmup,
            vision_batch_images=args.vision_batch_images,
            speculative_tokens=args.speculative_tokens, prompt_lookup_min=args.prompt_lookup_min,
            prompt_lookup_max=args.prompt_lookup_max, speculative_adaptive=args.speculative_policy == "adaptive",
            speculative_method="draft" if draft is not None else "ngram",
            draft_sample_method=args.draft_sample_method if draft is not None else "greedy",
            # compiling the programs in parallel threads pays off with many cores (accelerator hosts); on a small
            # CPU box XLA already keeps every core busy compiling one program
            parallel_compile=platform != "cpu"), draft_model=draft, mirror=mirror)
    except ValueError as e:
        return _fail(str(e))
    if mesh is not None and getattr(engine.runner, "mesh", None) is None:
        # A runner that lowers its programs for one device would die on the first request with a sharding mismatch
        # between the placed parameters and its caches: say so now instead.
        return _fail(f"--mesh {args.mesh}: this engine's ModelRunner does not place its programs on a device mesh "
                     "(it must take the mesh from model.mesh); serve with --mesh 1x1")
    log.info("compiling the engine programs (%d slots x %d tokens, prefill chunks %s) ...", args.max_num_seqs,
             max_len, list(engine.runner.chunk_sizes))
    if not leader:
        return follow(engine)
    engine.start()
    served = args.served_model_name or name
    from .images import ImageFetchConfig

    drain = Drain()
    app = build_app(engine, tokenizer, model_name=served, api_key=args.api_key,
                    guided_string_max_tokens=args.guided_string_max_tokens,
                    image_fetch=ImageFetchConfig(timeout_s=args.image_fetch_timeout,
                                                 allow_remote=not args.no_image_fetch,
                                                 allow_private=args.allow_private_image_urls),
                    max_request_bytes=args.max_request_bytes or None,
                    max_queued_requests=args.max_queued_requests or None, drain=drain,
                    profile_dir=args.profile_dir)
    fmt = app.state.kimi.chat_format
    log.info("chat format: %s; api key: %s", fmt.name if fmt else "none (completions only)",
             "required" if args.api_key else "off")
    log.info("serving %r at http://%s:%d  (OpenAI base_url http://%s:%d/v1)", served, args.host, args.port,
             args.host, args.port)

    try:
        run_server(app, host=args.host, port=args.port, log_level=args.log_level,
                   shutdown_timeout_s=args.shutdown_timeout, drain=drain, abort=engine.abort)
    finally:
        engine.shutdown()
        engine.mirror.stop()  # the other processes return from `follow`
    return 0


def follow(engine) -> int:
    """A process other than 0: compile the same programs, then run the device calls process 0 publishes until it
    stops (`engine.multihost`)."""
    from ..engine.prompt_logprobs import PromptScorer

    PromptScorer(engine.model, engine.max_model_len, engine.mirror)  # its program, registered as process 0's is
    t = engine.runner.compile(parallel=engine.config.parallel_compile)
    log.info("process %d: %d programs compiled in %.1fs; following process 0", distributed_process()[0],
             len(engine.runner.program_names), t)
    engine.mirror.follow()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(auto_devices=True))
