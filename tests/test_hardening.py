"""What a hostile or unlucky client can do to the server: SSRF through image URLs, large and deeply nested bodies,
out-of-range seeds, error bodies, the docs behind the API key, a burst beyond the queue, a failing engine step, a
checkpoint without its tokenizer.

Every HTTP server here listens on 127.0.0.1, and no test sends a packet to any other address: names that must
resolve are resolved by a patched resolver (``images._getaddrinfo``), and "public" destinations are loopback
addresses a test declares public (``images.is_public_address`` patched).  The apps share the session's engine
(``served``); each app that needs other settings runs in its own uvicorn thread over it.
"""

from __future__ import annotations

import http.server
import io
import ipaddress
import json
import socket
import threading
import time

import httpx
import numpy as np
import pytest

from kimi_jax.engine import SamplingParams
from kimi_jax.engine.sampling_params import ParamError
from kimi_jax.serve import images
from kimi_jax.serve.app import build_app
from kimi_jax.serve.images import ImageError, ImageFetchConfig, is_public_address, load_image
from kimi_jax.serve.server import ServerThread

MODEL = "tiny"
NO_THINK = {"chat_template_kwargs": {"thinking": False}}
FETCH_FAILED = "could not load an image from"
SMALL_LIMIT = 64 * 1024


def _png() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.full((8, 8, 3), 200, np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


class _Local:
    """An HTTP server on ``host`` (a loopback address) that serves a PNG at /x.png, redirects /go?to=URL, 404s the
    rest, and records every request's path and Host header."""

    def __init__(self, host: str = "127.0.0.1"):
        png, seen = _png(), []
        self.seen = seen

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 -- the stdlib's name
                seen.append((self.path, self.headers.get("Host")))
                if self.path.startswith("/go?to="):
                    self.send_response(302)
                    self.send_header("Location", self.path[len("/go?to="):])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                elif self.path == "/x.png":
                    self.send_response(200)
                    self.send_header("Content-Type", "image/png")
                    self.send_header("Content-Length", str(len(png)))
                    self.end_headers()
                    self.wfile.write(png)
                else:
                    self.send_error(404)

            def log_message(self, *args):
                pass

        self.srv = http.server.ThreadingHTTPServer((host, 0), Handler)
        self.port = self.srv.server_address[1]
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()

    def close(self):
        self.srv.shutdown()
        self.srv.server_close()


@pytest.fixture
def local():
    srv = _Local()
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def guarded(served):
    """An app over the shared engine with the defaults a deployment gets (private image URLs refused) and small
    limits: 64 KiB bodies."""
    srv = ServerThread(build_app(served.engine, served.tokenizer, model_name=MODEL,
                                 max_request_bytes=SMALL_LIMIT)).start()
    yield srv
    srv.stop()


def _image_chat(url: str) -> dict:
    return {"model": MODEL, "max_tokens": 2, **NO_THINK,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "look"},
                                                      {"type": "image_url", "image_url": {"url": url}}]}]}


# ============================================================================================== SSRF
@pytest.mark.parametrize("address", [
    "127.0.0.1", "127.255.0.9", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254", "100.64.0.1",
    "0.0.0.0", "224.0.0.1", "255.255.255.255", "240.0.0.1", "192.0.2.1",
    "::1", "::", "fe80::1", "fc00::1", "ff02::1", "::ffff:127.0.0.1", "::ffff:10.0.0.1", "::ffff:169.254.169.254",
    "64:ff9b::7f00:1", "64:ff9b::a00:1", "2002:7f00:1::1", "2002:a00:1::1", "2001::1", "::127.0.0.1",
])
def test_non_public_addresses_in_every_form_are_refused(address):
    assert not is_public_address(ipaddress.ip_address(address))


@pytest.mark.parametrize("address", ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "::ffff:8.8.8.8",
                                     "64:ff9b::808:808"])
def test_public_addresses_pass(address):
    assert is_public_address(ipaddress.ip_address(address))  # judged only: nothing is sent anywhere


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "2130706433", "0x7f000001", "017700000001", "127.1",
                                  "0x7f.0.0.1", "0177.0.0.01", "127.000.000.001", "[::ffff:127.0.0.1]", "[::1]"])
def test_loopback_in_every_spelling_is_refused_before_connecting(local, host):
    url = f"http://{host}:{local.port}/x.png"
    with pytest.raises(ImageError) as e:
        load_image(url, "img", ImageFetchConfig(timeout_s=5))
    assert str(e.value) == f"img: {FETCH_FAILED} {url}"
    assert local.seen == []  # refused after resolving, before any connection


def test_private_destinations_are_fetched_with_the_flag(local):
    img = load_image(f"http://127.0.0.1:{local.port}/x.png", "img", ImageFetchConfig(timeout_s=5,
                                                                                        allow_private=True))
    assert img.shape == (8, 8, 3) and local.seen == [("/x.png", f"127.0.0.1:{local.port}")]


@pytest.fixture
def two_hosts(monkeypatch):
    """A 'public' server on 127.0.0.2 (declared public for the test) and a private one on 127.0.0.1."""
    monkeypatch.setattr(images, "is_public_address", lambda ip: str(ip) == "127.0.0.2")
    public, private = _Local("127.0.0.2"), _Local("127.0.0.1")
    yield public, private
    public.close()
    private.close()


@pytest.mark.parametrize("target", ["http://127.0.0.1:{port}/x.png", "http://2130706433:{port}/x.png",
                                    "http://localhost:{port}/x.png", "/go?to=http://127.0.0.1:{port}/x.png"])
def test_a_redirect_to_a_private_address_is_refused(two_hosts, target):
    public, private = two_hosts
    ok = load_image(f"http://127.0.0.2:{public.port}/x.png", "img", ImageFetchConfig(timeout_s=5))
    assert ok.shape == (8, 8, 3)  # the "public" host itself is fine
    url = f"http://127.0.0.2:{public.port}/go?to=" + target.format(port=private.port)
    with pytest.raises(ImageError, match=FETCH_FAILED):
        load_image(url, "img", ImageFetchConfig(timeout_s=5))
    assert private.seen == []  # every hop is checked before it is connected to


def test_the_connection_goes_to_the_address_that_was_checked(two_hosts, monkeypatch):
    """DNS rebinding: the name answers a public address first and a private one afterwards.  It is resolved once
    per hop and the socket connects to that answer; the URL's name is only the Host header."""
    public, private = two_hosts
    calls = []

    def rebinding(host, port, *a, **k):
        calls.append(host)
        ip = "127.0.0.2" if len(calls) == 1 else "127.0.0.1"
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port))]

    monkeypatch.setattr(images, "_getaddrinfo", rebinding)
    img = load_image(f"http://rebind.test:{public.port}/x.png", "img", ImageFetchConfig(timeout_s=5))
    assert img.shape == (8, 8, 3)
    assert calls == ["rebind.test"] and public.seen == [("/x.png", f"rebind.test:{public.port}")]
    assert private.seen == []


def test_a_name_with_any_private_address_is_refused(two_hosts, monkeypatch):
    public, private = two_hosts
    monkeypatch.setattr(images, "_getaddrinfo", lambda host, port, *a, **k: [
        (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.2", port)),
        (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))])
    with pytest.raises(ImageError, match=FETCH_FAILED):
        load_image(f"http://mixed.test:{public.port}/x.png", "img", ImageFetchConfig(timeout_s=5))
    assert public.seen == [] and private.seen == []


def test_every_fetch_failure_reads_the_same(local):
    """No port-probing oracle: refused, 404, not an image, an unused port, too many redirects -- one text."""
    cfg = ImageFetchConfig(timeout_s=5, allow_private=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        unused = s.getsockname()[1]
    base = f"http://127.0.0.1:{local.port}"
    loop = f"{base}/go?to={base}/go?to={base}/go?to={base}/go?to={base}/go?to={base}/go?to={base}/x.png"
    urls = [f"{base}/missing.png", f"{base}/go?to=ftp://127.0.0.1/x.png", f"http://127.0.0.1:{unused}/x.png",
            loop, f"{base}/go?to=file:///etc/hostname"]
    for url in urls:
        with pytest.raises(ImageError) as e:
            load_image(url, "img", cfg)
        assert str(e.value) == f"img: {FETCH_FAILED} {images._short(url)}"
    small = ImageFetchConfig(timeout_s=5, allow_private=True, max_bytes=10)
    with pytest.raises(ImageError, match=FETCH_FAILED):
        load_image(f"{base}/x.png", "img", small)


def test_the_server_refuses_private_image_urls_by_default(guarded, local):
    r = httpx.post(guarded.url + "/v1/chat/completions", json=_image_chat(f"http://127.0.0.1:{local.port}/x.png"),
                   timeout=60)
    assert r.status_code == 400 and FETCH_FAILED in r.json()["error"]["message"]
    assert local.seen == []


def test_the_serve_cli_documents_the_flag():
    from kimi_jax.serve.__main__ import build_parser

    text = build_parser().format_help()
    for flag in ("--allow-private-image-urls", "--max-request-bytes", "--max-queued-requests", "--shutdown-timeout"):
        assert flag in text
    assert build_parser().parse_args(["--allow-private-image-urls"]).allow_private_image_urls


# ============================================================================================== request size
def test_a_body_above_the_limit_is_a_413(guarded):
    big = {"model": MODEL, "prompt": "a " * SMALL_LIMIT, "max_tokens": 1}
    r = httpx.post(guarded.url + "/v1/completions", json=big, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    ok = httpx.post(guarded.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1},
                    timeout=60)
    assert ok.status_code == 200


def test_the_413_comes_from_content_length_before_the_body(guarded):
    """A client that announces 1 GB and sends nothing gets its 413 at once: nothing waits for the body."""
    with socket.create_connection(("127.0.0.1", guarded.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000000000\r\n\r\n")
        head = s.recv(65536)
    assert head.startswith(b"HTTP/1.1 413")


def test_a_chunked_body_is_cut_off_at_the_limit(guarded):
    sent = []

    def chunks():
        for _ in range(64):
            sent.append(1)
            yield b"x" * 4096  # 256 KiB in all, without a Content-Length

    r = httpx.post(guarded.url + "/v1/completions", content=chunks(), timeout=60,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 413


def test_a_large_body_does_not_stall_streams_or_health(served):
    """A multi-megabyte request is parsed and tokenized in a worker thread: meanwhile a running stream keeps
    streaming and /health answers.  The bound is generous; the point is that nothing waits for the large one."""
    gaps, stop = [], threading.Event()

    def stream():
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 200, "ignore_eos": True, "stream": True,
                "temperature": 0}
        last = None
        with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                now = time.monotonic()
                if last is not None and not stop.is_set():
                    gaps.append(now - last)
                last = now

    t = threading.Thread(target=stream)
    t.start()
    time.sleep(1.0)
    big = {"model": MODEL, "prompt": ["lorem ipsum dolor sit amet " * 40000] * 8, "max_tokens": 1}  # ~9 MB
    result = {}
    poster = threading.Thread(target=lambda: result.setdefault(
        "r", httpx.post(served.url + "/v1/completions", json=big, timeout=300)))
    poster.start()
    health = []
    while poster.is_alive():
        t0 = time.monotonic()
        assert httpx.get(served.url + "/health", timeout=30).status_code == 200
        health.append(time.monotonic() - t0)
        time.sleep(0.05)
    stop.set()
    poster.join()
    t.join()
    assert result["r"].status_code == 400  # far beyond the context: refused, after tokenizing
    assert health and max(health) < 2.0, max(health)
    assert gaps and max(gaps) < 2.0, max(gaps)


# ============================================================================================== bodies and errors
@pytest.mark.parametrize("depth", [65, 100_000])
def test_deeply_nested_json_is_a_400(served, depth):
    raw = '{"model": "tiny", "prompt": "hi", "x": ' + "[" * depth + "]" * depth + "}"
    r = httpx.post(served.url + "/v1/completions", content=raw, headers={"Content-Type": "application/json"},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    assert "ecursion" not in r.text


def test_moderate_nesting_is_fine(served):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1, "user_data": json.loads("[" * 30 + "]" * 30)}
    assert httpx.post(served.url + "/v1/completions", json=body, timeout=60).status_code == 200


def test_a_500_carries_no_exception_text(served):
    class Exploding:
        def __init__(self, tok):
            self._tok = tok

        def __getattr__(self, name):
            return getattr(self._tok, name)

        def encode(self, *a, **k):
            raise RuntimeError("secret-internal-detail")

    srv = ServerThread(build_app(served.engine, Exploding(served.tokenizer), model_name=MODEL)).start()
    try:
        r = httpx.post(srv.url + "/tokenize", json={"prompt": "hi"}, timeout=60)
    finally:
        srv.stop()
    assert r.status_code == 500
    assert r.json() == {"error": {"message": "internal server error", "type": "server_error", "param": None,
                                  "code": None}}


@pytest.mark.parametrize("seed", [2 ** 64, 2 ** 70, 2 ** 63, -2 ** 63 - 1, 1e30])
def test_seeds_outside_int64_are_a_400(served, seed):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1, "seed": seed}
    r = httpx.post(served.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed"


def test_int64_seeds_at_the_edges_work(served):
    for seed in (2 ** 63 - 1, -2 ** 63):
        r = httpx.post(served.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1,
                                                             "seed": seed}, timeout=60)
        assert r.status_code == 200
    with pytest.raises(ParamError):
        SamplingParams(seed=2 ** 64).validate(1024)


def test_docs_and_schema_need_the_key_when_one_is_set(served):
    srv = ServerThread(build_app(served.engine, served.tokenizer, model_name=MODEL, api_key="sk-docs")).start()
    try:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert httpx.get(srv.url + path, timeout=30).status_code == 401, path
            r = httpx.get(srv.url + path, headers={"Authorization": "Bearer sk-docs"}, timeout=30)
            assert r.status_code == 200, path
        schema = httpx.get(srv.url + "/openapi.json", headers={"Authorization": "Bearer sk-docs"}, timeout=30).json()
        assert "/v1/chat/completions" in schema["paths"]
    finally:
        srv.stop()
    assert httpx.get(served.url + "/openapi.json", timeout=30).status_code == 200  # no key: open as before


# ============================================================================================== admission control
def test_beyond_the_queue_limit_is_a_429_with_retry_after(served, monkeypatch):
    srv = ServerThread(build_app(served.engine, served.tokenizer, model_name=MODEL, max_queued_requests=3)).start()
    try:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
        monkeypatch.setattr(served.engine, "queued_requests", lambda: 3)
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 429 and r.headers["Retry-After"] == "1"
        assert r.json()["error"]["code"] == "queue_full"
        monkeypatch.setattr(served.engine, "queued_requests", lambda: 2)
        assert httpx.post(srv.url + "/v1/completions", json=body, timeout=60).status_code == 200
    finally:
        srv.stop()


def test_queued_requests_counts_what_waits_for_slots(served):
    """Requests that each need every slot run one at a time: the others are counted as queued."""
    eng = served.engine
    streams = [eng.submit([5, 6, 7], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), n=eng.B)
               for _ in range(3)]
    assert eng.queued_requests() >= 1
    for s in streams:
        s.collect(eng.B)
    assert eng.queued_requests() == 0


# ============================================================================================== a failing step
def test_a_failing_step_ends_its_requests_and_health_recovers(served, monkeypatch):
    eng = served.engine
    real_step, broken = eng.runner.step, threading.Event()

    def step(*a, **k):
        if broken.is_set():
            raise RuntimeError("injected device fault")
        return real_step(*a, **k)

    monkeypatch.setattr(eng.runner, "step", step)
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 50, "ignore_eos": True, "temperature": 0}
    broken.set()
    with httpx.stream("POST", served.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    err = json.loads(lines[-2][len("data: "):])["error"]
    assert err["code"] == "engine_error" and "injected" not in json.dumps(err)
    h = httpx.get(served.url + "/health", timeout=30)
    assert h.status_code == 503 and h.headers.get("Retry-After") and "injected" not in h.text
    r = httpx.post(served.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 503 and r.headers.get("Retry-After")
    broken.clear()
    deadline = time.monotonic() + 30
    while httpx.get(served.url + "/health", timeout=30).status_code != 200:
        assert time.monotonic() < deadline, "the engine did not recover"
        time.sleep(0.1)
    r = httpx.post(served.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert eng.stats()["step_failures"] >= 1 and eng.alive


def test_a_failing_step_fails_a_non_streaming_request_promptly(served, monkeypatch):
    eng = served.engine
    real_step, broken = eng.runner.step, threading.Event()

    def step(*a, **k):
        if broken.is_set():
            broken.clear()  # one failure: the probe step after it succeeds
            raise RuntimeError("injected device fault")
        return real_step(*a, **k)

    monkeypatch.setattr(eng.runner, "step", step)
    broken.set()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, **NO_THINK}
    r = httpx.post(served.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_error"
    deadline = time.monotonic() + 30
    while not eng.healthy:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert httpx.post(served.url + "/v1/chat/completions", json=body, timeout=120).status_code == 200


# ============================================================================================== --checkpoint
def test_a_checkpoint_without_its_tokenizer_fails_before_any_weight_is_read(tmp_path, monkeypatch):
    from kimi_jax.serve import server
    from kimi_jax.config import get_preset
    from kimi_jax.serve.server import load_for_serving

    (tmp_path / "kimi_jax_config.json").write_text(get_preset("tiny").to_json())
    monkeypatch.setattr(server, "load_model", lambda *a, **k: pytest.fail("weights were loaded"))
    with pytest.raises(FileNotFoundError, match="tiktoken.model"):
        load_for_serving(str(tmp_path))


def test_a_converted_checkpoint_with_a_missing_part_fails_before_loading(tmp_path, monkeypatch):
    from kimi_jax.serve import server
    from convert import store
    from kimi_jax.config import get_preset
    from kimi_jax.serve.server import load_for_serving

    (tmp_path / "kimi_jax_config.json").write_text(get_preset("tiny").to_json())
    (tmp_path / store.META_NAME).write_text(json.dumps({"format": store.FORMAT, "version": store.FORMAT_VERSION,
                                                        "parts": ["params/part_00000"], "entries": []}))
    monkeypatch.setattr(server, "load_model", lambda *a, **k: pytest.fail("weights were loaded"))
    with pytest.raises(ValueError, match="missing"):
        load_for_serving(str(tmp_path))


def test_an_impossible_max_model_len_fails_before_loading(tmp_path, monkeypatch):
    from kimi_jax.serve import server
    from kimi_jax.config import get_preset
    from kimi_jax.serve.server import load_for_serving
    from kimi_jax.tokenizer import Tokenizer

    cfg = get_preset("tiny")
    (tmp_path / "kimi_jax_config.json").write_text(cfg.to_json())
    monkeypatch.setattr(Tokenizer, "from_dir", classmethod(lambda cls, *a, **k: Tokenizer.tiny()))
    monkeypatch.setattr(server, "load_model", lambda *a, **k: pytest.fail("weights were loaded"))
    with pytest.raises(ValueError, match="max-model-len"):
        load_for_serving(str(tmp_path), max_model_len=cfg.max_position_embeddings + 1)
