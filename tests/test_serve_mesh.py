"""`python -m kimi_jax.serve --mesh AxB` beyond one device, through the official ``openai`` client.

Two real server processes on 127.0.0.1 serve the tiny model with the same engine settings, one with ``--mesh 1x1``
and one with ``--mesh 8x1 --dcp 8 --fake-cpu-devices`` (parameters split eight ways over the "model" axis where they
divide, every op through its partitioned entry point, the MLA cache split eight ways by tokens) and speculative
decoding on (``--speculative-tokens 3``: its
verify program runs on the mesh).  Neither gets XLA_FLAGS: the 8x1 server fakes its eight CPU devices on request
(and logs that it did).  Both must return the same greedy text.  Without that flag, too few devices stop the
server with an error that names the XLA_FLAGS fix (DESIGN.md), for the tiny model as for any other.

Subprocesses, because the CPU device count is fixed once per process when JAX starts its backend.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from server_process import ServerProcess, server_env

ROOT = Path(__file__).resolve().parents[1]
SERVER_ARGS = ["--max-num-seqs", "2", "--max-model-len", "256", "--prefill-chunk-sizes", "64,16",
               "--log-level", "info"]
NO_THINK = {"chat_template_kwargs": {"thinking": False}}
START_TIMEOUT_S = 900  # compiling the tiny model's programs on 2 busy CPU cores


def _env() -> dict:
    return server_env()


def _server(tmp: Path, mesh: str) -> ServerProcess:
    cache = os.environ.get("JAX_COMPILATION_CACHE_DIR", "none")
    return ServerProcess(tmp / f"serve_{mesh}.log", [
        "--mesh", mesh, "--compilation-cache", cache, *SERVER_ARGS,
        *(["--fake-cpu-devices", "--dcp", "8", "--speculative-tokens", "3"] if mesh != "1x1" else [])])


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve_mesh")
    started = {mesh: _server(tmp, mesh) for mesh in ("1x1", "8x1")}  # both compile at the same time
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        for s in started.values():
            s.wait_ready(deadline)
        yield started
    finally:
        for s in started.values():
            s.stop()


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.mark.slow
def test_mesh_8x1_fakes_devices_and_matches_one_device(servers):
    one, two = servers["1x1"], servers["8x1"]
    log = two.log()
    assert "faked 8 CPU devices" in log, log[-3000:]
    assert "mesh 8x1" in log

    prompts = ["Tell me about the sea.", "Zähle bis fünf: 1, 2,"]
    for prompt in prompts:
        texts = {}
        for name, srv in servers.items():
            r = _client(srv).chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=12, temperature=0,
                extra_body=NO_THINK)
            assert r.choices[0].finish_reason in ("stop", "length")
            assert r.usage.completion_tokens > 0
            texts[name] = r.choices[0].message.content
        assert texts["8x1"] == texts["1x1"], (prompt, texts)

    # streaming from the sharded server gives the same text as its non-streamed answer
    stream = _client(two).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": prompts[0]}], max_tokens=12, temperature=0,
        stream=True, extra_body=NO_THINK)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    ref = _client(one).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": prompts[0]}], max_tokens=12, temperature=0,
        extra_body=NO_THINK).choices[0].message.content
    assert streamed == ref

    # an output that repeats itself (a logit bias): the 8x1 server's prompt-lookup drafts are accepted, and the text
    # is still the 1x1 server's, which decodes one token per step
    texts = {name: _client(srv).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": prompts[0]}], max_tokens=16, temperature=0,
        logit_bias={"13": 100}, extra_body=NO_THINK).choices[0].message.content for name, srv in servers.items()}
    assert texts["8x1"] == texts["1x1"]

    stats = httpx.get(two.url + "/stats", timeout=10).json()
    assert stats["spec_accepted_tokens"] > 0, stats
    assert stats["compilations"] == stats["compilations_at_start"], stats  # serving on the mesh never compiles
    # --dcp 8: the pages split eight ways by tokens (a table entry covers 512 positions; at 256 tokens per slot
    # each slot still takes one page per rank, so the bound of tests/test_sharded_serving.py does not apply here)
    one_stats = httpx.get(one.url + "/stats", timeout=10).json()
    assert stats["dcp"] == 8 and stats["block_tokens"] == 8 * one_stats["block_tokens"], stats
    assert stats["cache_bytes_per_device"] < one_stats["cache_bytes_per_device"] / 3, (stats, one_stats)


@pytest.mark.parametrize("model", ["tiny", "kimi-k3"])
def test_too_few_devices_is_a_clear_error_naming_the_fix(model):
    """DESIGN.md: `--mesh AxB` with fewer devices is a clear error that says how to fake devices on CPU — the
    default tiny model included (only --fake-cpu-devices fakes them); nothing is loaded, exit status 2."""
    r = subprocess.run([sys.executable, "-m", "kimi_jax.serve", "--model", model, "--mesh", "4x2"], cwd=ROOT,
                       env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "needs 8 devices" in r.stderr
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=8" in r.stderr
    assert "--fake-cpu-devices" in r.stderr


def test_fake_cpu_devices_overruled_by_xla_flags_says_so():
    """A device count in XLA_FLAGS wins over --fake-cpu-devices; when it is too small the error says that XLA_FLAGS
    set it (it used to tell the user to add --fake-cpu-devices, which they had given)."""
    env = dict(_env(), XLA_FLAGS="--xla_force_host_platform_device_count=2")
    r = subprocess.run([sys.executable, "-m", "kimi_jax.serve", "--mesh", "4x1", "--fake-cpu-devices", "--port", "0"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "needs 4 devices but only 2" in r.stderr
    assert "or add --fake-cpu-devices" not in r.stderr
    assert "--xla_force_host_platform_device_count=4 there or unset it" in r.stderr, r.stderr[-2000:]
