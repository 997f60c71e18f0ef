"""Images end to end: chat requests with ``image_url`` parts through the real server (official ``openai`` client),
the engine's image prefill against ``Model.generate(..., images=)``, the prefix cache with equal ids but different
images, preemption with images, and every bad image input as a 400.

Uses the shared engine + server of ``serve_helpers`` (prefill chunks 64 and 16, prefix cache on); the tiny preset
has a random toy vision tower (a 90×100 image is 16 tokens; each patch bucket compiles the tower once, in the
background).
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import http.server
import io
import logging
import socket
import threading

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from kimi_jax.engine import Engine, ParamError, SamplingParams
from kimi_jax.engine.prefix_cache import PrefixCache
from kimi_jax.paged_cache import BlockAllocator
from kimi_jax.serve.app import build_app
from kimi_jax.serve.chat import ChatImage, encode_chat
from kimi_jax.serve.formats import KimiLinearFormat
from kimi_jax.serve.images import chat_image
from kimi_jax.serve.server import ServerThread
from kimi_jax.tokenizer import Tokenizer

MODEL = "tiny"
NO_THINK = {"chat_template_kwargs": {"thinking": False}}
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


def _image(seed: int, h: int = 100, w: int = 90) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _png_bytes(img: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    return buf.getvalue()


def _data_url(img: np.ndarray) -> str:
    return "data:image/png;base64," + base64.b64encode(_png_bytes(img)).decode()


def _image_msgs(url: str, text: str = "what is in this picture?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text},
                                         {"type": "image_url", "image_url": {"url": url, "detail": "low"}},
                                         {"type": "text", "text": " answer briefly"}]}]


def _prompt_with_image(tok, before: int, count: int, after: int, seed: int = 0) -> list[int]:
    """Text ids, then a media block of ``count`` pads starting at position ``before + 1``, then more text."""
    rng = np.random.default_rng(seed)
    text = lambda n: [int(x) for x in rng.integers(0, 900, n)]  # noqa: E731 -- plain tiny-vocab ids
    return (text(before) + [tok.token_id("<|media_begin|>")] + [tok.token_id("<|media_pad|>")] * count
            + [tok.token_id("<|media_end|>")] + text(after))


# ================================================================================================== server


def test_chat_with_image_data_url_counts_the_image_tokens(client, served):
    img = _image(1)
    tok = served.tokenizer
    msgs = _image_msgs(_data_url(img))
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0, extra_body=NO_THINK)
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1

    ci = chat_image(img, served.model.config.vision)
    assert ci == ChatImage(width=90, height=100, num_tokens=16)  # 100×90 pads to 112×112: an 8×8 grid, 2×2 merged
    expected = encode_chat(tok, msgs, thinking=False, images=[ci])
    pad = tok.token_id("<|media_pad|>")
    assert expected.count(pad) == 16
    block = ([tok.token_id("<|media_begin|>")] + tok.encode("image 90x100") + [tok.token_id("<|media_content|>")]
             + [pad] * 16 + [tok.token_id("<|media_end|>")])
    start = expected.index(tok.token_id("<|media_begin|>"))
    assert expected[start: start + len(block)] == block
    assert r.usage.prompt_tokens == len(expected)
    tokenized = httpx.post(served.url + "/tokenize", json={"messages": msgs, **NO_THINK}, timeout=60).json()
    assert tokenized["tokens"] == expected


def test_image_fetched_over_http_and_fetch_failures(client, served):
    """An http URL is fetched (a local server here; the shared server allows loopback destinations); a 404 and a
    refused connection are the same 400, naming the URL and nothing about what answered."""
    png = _png_bytes(_image(2))

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 -- the stdlib's name
            if self.path == "/cat.png":
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(png)))
                self.end_headers()
                self.wfile.write(png)
            else:
                self.send_error(404)

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        r = client.chat.completions.create(model=MODEL, messages=_image_msgs(base + "/cat.png"), max_tokens=2,
                                           extra_body=NO_THINK)
        assert r.usage.prompt_tokens > 16
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=_image_msgs(base + "/missing.png"), max_tokens=2)
        missing = e.value.body["message"]
        # The port is random and may itself contain "404": look for the status outside the URL.
        assert "/missing.png" in missing and "404" not in missing.replace(base + "/missing.png", "<url>")
    finally:
        srv.shutdown()
        srv.server_close()
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}/x.png"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=_image_msgs(closed), max_tokens=2)
    assert e.value.body["message"] == missing.replace(base + "/missing.png", closed)


_HELLO = base64.b64encode(b"hello, not an image").decode()


@pytest.mark.parametrize("messages, says", [
    (_image_msgs("data:image/png;base64," + _HELLO), "cannot decode the image"),
    (_image_msgs("data:image/png;base64,"), "cannot decode the image"),
    (_image_msgs("data:image/png;base64,@@@not-base64@@@"), "base64"),
    (_image_msgs("data:text/plain;base64," + _HELLO), "not an image type"),
    (_image_msgs("file:///etc/hostname"), "unsupported image URL scheme 'file'"),
    (_image_msgs("ftp://example.com/a.png"), "unsupported image URL scheme 'ftp'"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "image_url"),
    ([{"role": "system", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}]},
      {"role": "user", "content": "hi"}], "only allowed in user messages"),
    ([{"role": "user", "content": "hi"},
      {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}]},
      {"role": "user", "content": "and?"}], "only allowed in user messages"),
    ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}],
     "not supported"),
])
def test_bad_images_get_400(client, messages, says):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, extra_body=NO_THINK)
    err = e.value.body
    assert e.value.status_code == 400 and err["param"] == "messages" and says in err["message"], err


def test_too_many_image_tokens_for_the_context_and_the_server_lives_on(client, served):
    big = np.full((1000, 1000, 3), 200, np.uint8)  # 72×72 patches after padding: 1296 tokens > max_model_len 512
    assert chat_image(big, served.model.config.vision).num_tokens == 1296
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=_image_msgs(_data_url(big)), max_tokens=2)
    assert e.value.code == "context_length_exceeded" and "maximum context length" in e.value.body["message"]
    r = client.chat.completions.create(model=MODEL, messages=_image_msgs(_data_url(_image(1))), max_tokens=2,
                                       extra_body=NO_THINK)
    assert r.usage.completion_tokens >= 1
    st = served.engine.stats()
    assert st["alive"] and st["error"] is None


class _TextOnlyView:
    """The shared engine as a server of a model without a vision tower sees it (no second compile)."""

    def __init__(self, engine):
        self._engine = engine
        self.model = copy.copy(engine.model)
        self.model.vision = None

    def __getattr__(self, name):
        return getattr(self._engine, name)


def test_images_refused_without_a_vision_tower_or_with_the_k2_format(served):
    msgs = _image_msgs(_data_url(_image(3)))
    fronts = [(build_app(_TextOnlyView(served.engine), served.tokenizer, model_name=MODEL), "no vision tower"),
              (build_app(served.engine, Tokenizer.tiny("k2"), model_name=MODEL,
                         chat_format=KimiLinearFormat(Tokenizer.tiny("k2"))), "has no image form")]
    for app, says in fronts:
        srv = ServerThread(app).start()
        try:
            r = httpx.post(srv.url + "/v1/chat/completions", json={"model": MODEL, "messages": msgs, "max_tokens": 2},
                           timeout=60)
            assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
            r = httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                           json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            assert r.status_code == 200
        finally:
            srv.stop()


# ================================================================================================== engine


def test_engine_with_images_equals_model_generate_across_chunk_boundaries(served, tiny_model):
    """Chunks are 64 and 16 tokens: image 1's 16 tokens sit at 61..76 (across the 64 boundary), image 2's 9 at
    90..98 (across the 96 boundary).  Greedy engine output == Model.generate with the same images."""
    tok, eng = served.tokenizer, served.engine
    img1, img2 = _image(10), _image(11, 60, 70)
    assert [chat_image(i, tiny_model.config.vision).num_tokens for i in (img1, img2)] == [16, 9]
    ids = _prompt_with_image(tok, 60, 16, 12, seed=5)
    ids += [tok.token_id("<|media_begin|>")] + [tok.token_id("<|media_pad|>")] * 9 + [tok.token_id("<|media_end|>")]
    ids += _prompt_with_image(tok, 20, 0, 0, seed=6)[:20]
    pads = [i for i, t in enumerate(ids) if t == tok.token_id("<|media_pad|>")]
    assert pads[0] < 64 <= pads[15] and pads[16] < 96 <= pads[-1]
    chunks_before = eng.stats()["num_prefill_chunks"]
    out, done = eng.submit(ids, GREEDY, images=[img1, img2]).collect(1)
    assert eng.stats()["num_prefill_chunks"] - chunks_before == 3 + 1  # 64 + 16 + 16 + 16 (prompt 121 tokens)
    ref = tiny_model.generate([ids], GREEDY.max_tokens, images=[img1, img2])[0, len(ids):]
    assert out[0].token_ids == ref.tolist()
    assert done.num_prompt_tokens == len(ids)
    # refusals at submit: pads that do not match the images, and image tokens that would ride the decode steps
    with pytest.raises(ParamError, match="need 25"):
        eng.submit(ids[:-3] + [tok.token_id("<|media_pad|>")] * 3, GREEDY, images=[img1, img2])
    with pytest.raises(ParamError, match="ride the decode steps"):
        eng.submit(_prompt_with_image(tok, 60, 16, 2), GREEDY, images=[img1])
    with pytest.raises(ParamError, match="uint8 RGB"):
        eng.submit(ids, GREEDY, images=[img1.astype(np.float32), img2])


def test_a_new_image_size_compiles_in_the_background_while_others_decode(served, tiny_model, monkeypatch, caplog):
    """The first image of a patch bucket no one has used (a 200×200 image: 256 patches, 64 tokens) has its tower
    program compiled in a background thread: its request waits at the head of the queue while a running text
    request keeps decoding, then runs and equals Model.generate. The compile is held on a gate here so that the
    overlap is certain, not a race."""
    from kimi_jax.modules import vision_buckets as VB

    tok, eng = served.tokenizer, served.engine
    img = _image(40, 200, 200)
    size = VB.bucket_for(256, tiny_model.config.vision)
    programs = VB.programs_for(tiny_model.vision)
    assert size == 256 and size not in programs._compiles, "the bucket must be new to this process"
    caplog.set_level(logging.INFO, logger="kimi_jax.engine")
    gate, warm = threading.Event(), VB.BucketPrograms._warm
    monkeypatch.setattr(VB.BucketPrograms, "_warm", lambda self, n: (gate.wait(60), warm(self, n)))
    text = eng.submit(_prompt_with_image(tok, 40, 0, 0, seed=11)[:40],
                      SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True))
    ids = _prompt_with_image(tok, 10, 64, 20, seed=12)
    image_req = eng.submit(ids, GREEDY, images=[img])
    got = 0
    while got < 20:  # the text request streams while the image request's bucket is held (a stall: Empty)
        ev = text._q.get(timeout=60)
        got += len(getattr(ev, "token_ids", ()) or ())
    assert not programs._compiles[size].done() and image_req._q.empty()
    assert any(image_req.request_id in r.getMessage() and "patch buckets [256]" in r.getMessage()
               for r in caplog.records)  # the log says why it waits
    gate.set()
    out, _ = image_req.collect(1)
    ref = tiny_model.generate([ids], GREEDY.max_tokens, images=[img])[0, len(ids):]
    assert out[0].token_ids == ref.tolist()
    eng.abort(text.request_id)


def test_prefix_cache_does_not_mix_images(served, tiny_model):
    """Equal ids, different images: the second request must not reuse the first one's snapshot (it would get the
    first image's output); the same image again does hit the cache and gives the same tokens."""
    tok, eng = served.tokenizer, served.engine
    img_a, img_b = _image(20), _image(21)
    ids = _prompt_with_image(tok, 10, 16, 70, seed=7)  # 98 tokens: prefill 96 = 64 + 16 + 16
    p = GREEDY.replace(logprobs=True, top_logprobs=3)
    a1, da1 = eng.submit(ids, p, images=[img_a]).collect(1)
    b, db = eng.submit(ids, p, images=[img_b]).collect(1)
    a2, da2 = eng.submit(ids, p, images=[img_a]).collect(1)
    assert (da1.num_cached_tokens, db.num_cached_tokens, da2.num_cached_tokens) == (0, 0, 96)
    assert a2[0].token_ids == a1[0].token_ids
    assert a1[0].logprobs[0].top != b[0].logprobs[0].top  # the image reaches the logits
    ref_b = tiny_model.generate([ids], GREEDY.max_tokens, images=[img_b])[0, len(ids):]
    assert b[0].token_ids == ref_b.tolist()
    # the same ids without images (the pads as plain tokens) share nothing with either
    _, dt = eng.submit(ids, GREEDY).collect(1)
    assert dt.num_cached_tokens == 0


def test_waiting_requests_images_share_one_tower_call(served, tiny_model, monkeypatch):
    """Image requests queued together: the head's images and those of the requests behind it (their buckets
    compiled) go through the tower in one `encode_images` call, up to `vision_batch_images` images, a text
    request between them notwithstanding; each output equals Model.generate with its own images. When a batch
    fails, the head is encoded alone, and only the request whose image fails is aborted. (The requests queue
    while a first request's tower call is held on a gate.)"""
    tok = served.tokenizer
    encode = type(tiny_model).encode_images
    poison = _image(99)  # the others' size: its bucket is compiled, so it joins a batch
    calls, held, gate = [], threading.Event(), threading.Event()

    def recording(self, images):
        if not held.is_set():  # the first request's call: hold it until the rest are queued
            held.set()
            gate.wait(60)
        else:
            calls.append(len(images))
        if any((im == poison).all() for im in images if im.shape == poison.shape):
            raise RuntimeError("this image breaks the tower")
        return encode(self, images)

    monkeypatch.setattr(type(tiny_model), "encode_images", recording)

    def run(config, prompts, images):
        held.clear()
        gate.clear()
        calls.clear()
        eng = Engine(tiny_model, tok, dataclasses.replace(config, prefix_caching=False), runner=served.engine.runner)
        eng.start()
        try:
            first = eng.submit(_prompt_with_image(tok, 8, 16, 20, seed=19), GREEDY, images=[_image(54)])
            assert held.wait(60)
            streams = [eng.submit(ids, GREEDY, images=im) for ids, im in zip(prompts, images)]
            gate.set()
            first.collect(1)
            return [s.collect(1) for s in streams]
        finally:
            eng.shutdown()

    imgs = [[_image(50), _image(51, 60, 70)], None, [_image(52)], [_image(53)]]  # 16 + 9, -, 16, 16 tokens
    two = _prompt_with_image(tok, 10, 16, 4, seed=20) + _prompt_with_image(tok, 0, 9, 20, seed=25)
    prompts = [two, _prompt_with_image(tok, 30, 0, 0, seed=21)[:30], _prompt_with_image(tok, 12, 16, 20, seed=22),
               _prompt_with_image(tok, 14, 16, 20, seed=23)]
    for vision_batch, want_calls in ((16, [4]), (3, [3, 1])):
        got = run(dataclasses.replace(served.engine.config, vision_batch_images=vision_batch), prompts, imgs)
        assert calls == want_calls, vision_batch  # 16: all four images at once; 3: the head's two + one, then one
        for ids, im, (out, _) in zip(prompts, imgs, got):
            assert out[0].token_ids == tiny_model.generate([ids], GREEDY.max_tokens, images=im)[0, len(ids):].tolist()
    # a poisoned image in the second request: the batch fails, the head runs alone, the poisoned one is aborted
    bad = _prompt_with_image(tok, 10, 16, 20, seed=24)
    first, failed, last = run(served.engine.config, [prompts[2], bad, prompts[3]], [imgs[2], [poison], imgs[3]])
    assert (first[1].finish_reasons, failed[1].finish_reasons, last[1].finish_reasons) == (["length"], ["abort"],
                                                                                           ["length"])
    assert calls[:2] == [3, 1]  # the batch of three, then the head alone
    assert first[0][0].token_ids == tiny_model.generate([prompts[2]], GREEDY.max_tokens,
                                                        images=imgs[2])[0, len(prompts[2]):].tolist()


def test_vision_batch_flag_and_config_refuse_zero(served, tiny_model, capsys):
    from kimi_jax.serve.__main__ import build_parser, main

    assert main(["--vision-batch-images", "0"]) == 2 and "--vision-batch-images" in capsys.readouterr().err
    assert "--vision-batch-images" in build_parser().format_help()
    with pytest.raises(ValueError, match="vision_batch_images"):
        Engine(tiny_model, served.tokenizer, dataclasses.replace(served.engine.config, vision_batch_images=0),
               runner=served.engine.runner)


def test_preemption_recomputes_with_the_same_image_features(served, tiny_model):
    """A second engine over the shared compiled programs, its allocator cut to 8 pages (one max_model_len
    sequence): a text request and an image request of 5 pages each cannot both finish, the image request (the
    youngest) is preempted and recomputed -- with its features, so its output equals the one it gets alone."""
    tok = served.tokenizer
    eng = Engine(tiny_model, tok, dataclasses.replace(served.engine.config, prefix_caching=False),
                 runner=served.engine.runner)
    eng.alloc = BlockAllocator(9)  # pages 1..8 of the runner's larger pool
    eng.prefix_cache = PrefixCache(eng.alloc, enabled=False)
    eng.start()
    try:
        img = _image(30)
        ids = _prompt_with_image(tok, 40, 16, 40, seed=8)  # 98 tokens
        text_ids = _prompt_with_image(tok, 97, 0, 0, seed=9)[:98]
        p = SamplingParams(max_tokens=170, temperature=0.0, ignore_eos=True)
        alone = eng.submit(ids, p, images=[img]).collect(1)[0][0].token_ids
        assert eng.stats()["num_preemptions"] == 0
        s_text = eng.submit(text_ids, p)
        s_img = eng.submit(ids, p, images=[img])
        s_text.collect(1)
        together = s_img.collect(1)[0][0].token_ids
        st = eng.stats()
        assert st["num_preemptions"] > 0 and together == alone
        assert st["images_encoded"] == 2  # once per request: the recompute reused the features
        assert st["free_blocks"] == 8
    finally:
        eng.shutdown()
