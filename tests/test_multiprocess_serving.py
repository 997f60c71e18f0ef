"""`python -m kimi_jax.serve` as two processes of four faked CPU devices each (jax.distributed, gloo collectives),
against one single-device server (docs/serving.md, "Several processes").

The same command runs on both processes; process 0 listens and schedules, process 1 replays its device calls
(`kimi_jax.engine.multihost`), with overlapped decode steps (`--async-scheduling`: process 0 publishes the next step
before it reads this one's tokens). The mesh `context=4,tensor=2` with `--dcp 4` spans both: the MLA pages split
over the context axis, heads over tensor, and prefill chunks run token-split over the context axis. The two-process
server must give the same greedy tokens as one device, with log-probs within float32 noise — for concurrent
requests, prompts of several token-split chunks, prompt log-probs (lm-evaluation-harness's echo), an image prompt
(the vision tower on process 0), and with so few pages that sequences are preempted and recomputed. A process killed
mid-stream ends the stream and the server (a non-zero exit within the heartbeat timeout), never a hang.
"""

from __future__ import annotations

import base64
import concurrent.futures
import io
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
from PIL import Image

from server_process import ROOT, ServerProcess, free_port, server_env, wait_healthy

HEARTBEAT_S = 5
COMMON = ["--max-num-seqs", "4", "--max-model-len", "768", "--prefill-chunk-sizes", "64,1", "--log-level", "info"]


class Launch:
    """The processes of one multi-process server; `url` is process 0's."""

    def __init__(self, tmp, args: list, processes: int = 2):
        self.port, coordinator = free_port(), free_port()
        self.logs = [tmp / f"process{i}.log" for i in range(processes)]
        self.procs = []
        for i in range(processes):
            cmd = [sys.executable, "-m", "kimi_jax.serve", "--port", str(self.port), *args,
                   "--coordinator-address", f"127.0.0.1:{coordinator}", "--num-processes", str(processes),
                   "--process-id", str(i), "--heartbeat-timeout", str(HEARTBEAT_S)]
            with open(self.logs[i], "w") as log:  # the child keeps its own descriptor
                self.procs.append(subprocess.Popen(cmd, cwd=ROOT, env=server_env(), stdout=log,
                                                   stderr=subprocess.STDOUT))
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, deadline: float) -> None:
        wait_healthy(self.url, self.procs, self.logs, deadline)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(30)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """(two-process server, one-device server), started together (their programs compile at the same time)."""
    tmp = tmp_path_factory.mktemp("multiprocess")
    cache = ["--compilation-cache", str(tmp / "jax_cache")]
    # the pages split 4 ways over a context axis (and heads 2 ways over tensor), chunks of 64 prefilled token-split
    # over it; 4 pages of 256 positions (64 per DCP rank): 3 usable for 4 slots of up to 768 tokens -> preemptions
    multi = Launch(tmp, ["--mesh", "context=4,tensor=2", "--dcp", "4", "--token-split-min-tokens", "64",
                         "--fake-cpu-devices", "--num-blocks", "4", "--async-scheduling", *COMMON, *cache])
    single = ServerProcess(tmp / "single.log", [*COMMON, *cache])
    try:
        deadline = time.monotonic() + 900
        multi.wait_ready(deadline)
        single.wait_ready(deadline)
        yield multi, single
    finally:
        multi.stop()
        single.stop()


def _complete(url: str, prompt: list, max_tokens: int, **extra) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "logprobs": 1,
            "ignore_eos": True, **extra}
    r = httpx.post(url + "/v1/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _together(url: str, prompts: list, max_tokens: int) -> list:
    """The prompts submitted at once (batched into the same decode steps)."""
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: _complete(url, p, max_tokens), prompts))


def _prompts(lengths) -> list:
    rng = np.random.RandomState(0)
    return [list(map(int, rng.randint(5, 900, n))) for n in lengths]


def _same(got: list, want: list) -> None:
    for g, w in zip(got, want):
        assert g["text"] == w["text"]
        np.testing.assert_allclose(g["logprobs"]["token_logprobs"], w["logprobs"]["token_logprobs"], atol=2e-4)


def test_two_processes_give_one_devices_tokens_with_token_split_prefill(servers):
    multi, single = servers
    stats = httpx.get(multi.url + "/stats").json()
    assert stats["processes"] == 2 and stats["dcp"] == 4 and stats["token_split_chunk_sizes"] == [64]
    assert stats["async_scheduling"]
    prompts = _prompts([5, 70, 230, 240])  # 0 to 3 token-split chunks each, the rest through the decode step
    _same(_together(multi.url, prompts, 40), _together(single.url, prompts, 40))
    assert httpx.get(multi.url + "/stats").json()["token_split_prefill_tokens"] >= 64 * 7


def test_two_processes_preempt_and_recompute_as_one_device_does(servers):
    """Two sequences each grow to 2 pages of 256 positions; 3 are usable, so one is preempted and recomputed
    (its prompt and what it generated, prefilled token-split again)."""
    multi, single = servers
    before = httpx.get(multi.url + "/stats").json()
    prompts = _prompts([5, 10])
    _same(_together(multi.url, prompts, 300), _together(single.url, prompts, 300))
    after = httpx.get(multi.url + "/stats").json()
    assert after["num_preemptions"] > before["num_preemptions"]
    # steps chained on the device, replayed by the follower (also while the preempted sequence waits for pages)
    assert after["steps_overlapped"] - before["steps_overlapped"] >= 100, (before, after)


def test_prompt_logprobs_across_processes(servers):
    multi, single = servers
    prompt = _prompts([90])[0]
    got = _complete(multi.url, prompt, 0, echo=True)["logprobs"]["token_logprobs"]
    want = _complete(single.url, prompt, 0, echo=True)["logprobs"]["token_logprobs"]
    assert got[0] is None and want[0] is None
    np.testing.assert_allclose(got[1:], want[1:], atol=2e-4)


def test_an_image_prompt_across_processes(servers):
    """The vision tower runs on process 0; its features reach process 1 as inputs of the image prefill chunks."""
    multi, single = servers
    image = np.random.default_rng(3).integers(0, 256, (100, 90, 3), dtype=np.uint8)  # 16 image tokens
    png = io.BytesIO()
    Image.fromarray(image).save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    content = [{"type": "text", "text": "what is in this picture?"}, {"type": "image_url", "image_url": {"url": url}}]
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 24,
            "temperature": 0.0, "logprobs": True, "ignore_eos": True, "chat_template_kwargs": {"thinking": False}}
    before = httpx.get(multi.url + "/stats").json()["images_encoded"]
    got, want = (httpx.post(url_ + "/v1/chat/completions", json=body, timeout=600) for url_ in (multi.url, single.url))
    assert got.status_code == 200 and want.status_code == 200, (got.text, want.text)
    got, want = got.json(), want.json()
    assert got["usage"] == want["usage"] and got["usage"]["prompt_tokens"] > 16
    assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    np.testing.assert_allclose([t["logprob"] for t in got["choices"][0]["logprobs"]["content"]],
                               [t["logprob"] for t in want["choices"][0]["logprobs"]["content"]], atol=2e-4)
    assert httpx.get(multi.url + "/stats").json()["images_encoded"] == before + 1


def test_a_killed_process_ends_the_stream_and_the_server(servers):
    """Last in this module: it takes the two-process server down."""
    multi, _ = servers
    leader, follower = multi.procs
    events = []

    def stream():
        body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 700, "temperature": 0.0, "stream": True,
                "ignore_eos": True}
        try:
            with httpx.stream("POST", multi.url + "/v1/completions", json=body, timeout=120) as r:
                if r.status_code != 200:
                    events.append(f"status {r.status_code}: {r.read().decode()[:300]}")
                    return
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
        except httpx.HTTPError as e:  # the server process went away mid-stream: the connection drops
            events.append(f"closed: {type(e).__name__}")

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        done = pool.submit(stream)
        while len(events) < 3:  # streaming
            assert not done.done() and not (events and events[0].startswith("status")), events
            time.sleep(0.05)
        follower.kill()
        killed = time.monotonic()
        leader.wait(HEARTBEAT_S + 60)
        done.result(timeout=60)
    assert leader.returncode != 0
    assert time.monotonic() - killed < HEARTBEAT_S + 60
    # the client saw an end: an error event (and [DONE]) or the connection closing -- not a stream that just stops
    assert events[-1] == "[DONE]" and any('"error"' in e for e in events) or events[-1].startswith("closed"), \
        events[-3:]
