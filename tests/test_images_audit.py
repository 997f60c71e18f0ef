"""Regression tests from the black-box audit of image inputs: decoding of unusual / broken files, and http(s)
fetch limits (``kimi_jax.serve.images``), plus the server's answer to them."""

from __future__ import annotations

import base64
import contextlib
import http.server
import io
import socket
import struct
import threading
import time

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from kimi_jax.serve.images import ImageError, ImageFetchConfig, decode_image, load_image

NO_THINK = {"chat_template_kwargs": {"thinking": False}}


def _png(img, **kw) -> bytes:
    buf = io.BytesIO()
    (img if isinstance(img, Image.Image) else Image.fromarray(img)).save(buf, format="PNG", **kw)
    return buf.getvalue()


def _rand(h: int, w: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _broken_png() -> bytes:
    """A PNG whose IDAT length is 5 short: Pillow raises SyntaxError ("broken PNG file"), not OSError."""
    d = bytearray(_png(_rand(20, 30)))
    i = d.find(b"IDAT") - 4
    d[i:i + 4] = struct.pack(">I", struct.unpack(">I", d[i:i + 4])[0] - 5)
    return bytes(d)


def test_a_broken_png_is_an_image_error_not_a_syntax_error():
    with pytest.raises(ImageError, match="cannot decode the image"):
        decode_image(_broken_png(), "img")


def test_a_broken_png_is_a_400_and_the_server_lives_on(client):
    url = "data:image/png;base64," + base64.b64encode(_broken_png()).decode()
    msgs = [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": url}}]}]
    with pytest.raises(openai.BadRequestError) as e:  # was a 500 (SyntaxError escaped decode_image)
        client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, extra_body=NO_THINK)
    assert e.value.body["code"] == "invalid_image" and "cannot decode the image" in e.value.body["message"]
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       extra_body=NO_THINK)
    assert r.usage.completion_tokens >= 1


@contextlib.contextmanager
def _raw_tcp_server(reply: bytes, drip_s: float = 0.0, drip_from: int = 0):
    """A TCP server that answers every connection with ``reply`` and closes it; with ``drip_s``, the bytes from
    ``drip_from`` on come one every ``drip_s`` seconds."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                try:
                    conn.recv(65536)
                    conn.sendall(reply if not drip_s else reply[:drip_from])
                    for i in range(drip_from, len(reply) if drip_s else 0):
                        if stop.wait(drip_s):
                            break
                        conn.sendall(reply[i:i + 1])
                except OSError:
                    pass

    threading.Thread(target=serve, daemon=True).start()  # one connection at a time
    try:
        yield f"http://127.0.0.1:{srv.getsockname()[1]}"
    finally:
        stop.set()
        srv.close()


FETCH_FAILED = "could not load an image from"  # the one answer to every failed fetch (images._fetch_failed)


def test_fetch_failures_outside_oserror_are_image_errors(caplog):
    """A reply that is not HTTP (BadStatusLine), a URL http.client refuses (InvalidURL: a space or CR/LF in the
    path) and a broken IPv6 host were 500s.  They are the one fetch failure now; the reason is in the log."""
    cfg = ImageFetchConfig(timeout_s=5, allow_private=True)  # the test servers listen on loopback
    caplog.set_level("INFO", logger="kimi_jax.serve")
    with _raw_tcp_server(b"GARBAGE NOT HTTP\r\n\r\n") as base:
        with pytest.raises(ImageError, match=FETCH_FAILED):
            load_image(base + "/x.png", "img", cfg)
        assert "BadStatusLine" in caplog.text
        with pytest.raises(ImageError, match=FETCH_FAILED):
            load_image(base + "/a b.png", "img", cfg)
        assert "InvalidURL" in caplog.text
        with pytest.raises(ImageError, match=f"(?s){FETCH_FAILED}"):
            load_image(base + "/a\r\nX-Injected: 1", "img", cfg)
    with pytest.raises(ImageError, match=FETCH_FAILED):
        load_image("http://[::1/x.png", "img", cfg)


def test_a_malformed_image_url_is_a_400(client):
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://[::1/x.png"}}]}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, extra_body=NO_THINK)
    assert e.value.body["code"] == "invalid_image" and "http://[::1/x.png" in e.value.body["message"]


@pytest.mark.parametrize("where", ["body", "headers"])
def test_the_fetch_timeout_bounds_the_whole_fetch(where):
    """A server that trickles its reply a byte at a time (each read well within the socket timeout) held the fetch
    -- and the request -- for as long as it liked; the timeout now bounds the whole fetch."""
    png = _png(_rand(30, 40))
    head = f"HTTP/1.0 200 OK\r\nContent-Type: image/png\r\nContent-Length: {len(png)}\r\n\r\n".encode()
    reply = head + png
    with _raw_tcp_server(reply, drip_s=0.05, drip_from=len(head) if where == "body" else 0) as base:
        cfg = ImageFetchConfig(timeout_s=1.0, allow_private=True)
        t0 = time.monotonic()
        with pytest.raises(ImageError, match=FETCH_FAILED):
            load_image(base + "/x.png", "img", cfg)
        assert time.monotonic() - t0 < 3.0
    with _raw_tcp_server(reply) as base:  # the same reply at once is fine
        assert load_image(base + "/x.png", "img", ImageFetchConfig(timeout_s=5, allow_private=True)).shape == \
            (30, 40, 3)


def _with_orientation(img: np.ndarray, orientation: int, fmt: str = "JPEG") -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format=fmt, exif=exif.tobytes(), **({"quality": 95} if fmt == "JPEG" else {}))
    return buf.getvalue()


@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_exif_orientation_turns_the_image_upright(orientation):
    """A phone photo stored sideways with EXIF orientation 6 reached the model sideways (and its prompt said
    'image 60x20' for a picture shown as 20x60); it is now turned as browsers / transformers' load_image show it."""
    img = _rand(20, 60, seed=orientation)
    got = decode_image(_with_orientation(img, orientation, "PNG"), "img")
    want = {3: np.rot90(img, 2), 6: np.rot90(img, -1), 8: np.rot90(img, 1)}[orientation]
    np.testing.assert_array_equal(got, want)


def test_exif_orientation_in_the_prompt_and_a_broken_exif_block(served):
    img = _rand(20, 60, seed=1)
    url = "data:image/jpeg;base64," + base64.b64encode(_with_orientation(img, 6)).decode()
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
    r = httpx.post(served.url + "/tokenize", json={"messages": msgs, "return_token_strs": True}, timeout=60).json()
    assert "image 20x60" in "".join(r["token_strs"])  # width x height of the upright picture
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="JPEG", exif=b"Exif\x00\x00not a tiff header")
    assert decode_image(buf.getvalue(), "img").shape == (20, 60, 3)  # unreadable EXIF: pixels as stored


def test_transparency_is_composited_onto_white():
    """Black text on a transparent background (RGBA with black, fully transparent pixels) decoded to an all-black
    image: the alpha was dropped.  Transparent pixels are now white, half-transparent ones blend, as transformers'
    convert_to_rgb and vLLM do; a palette PNG with a transparent colour and an LA image too."""
    rgba = np.zeros((8, 10, 4), np.uint8)  # black everywhere, transparent ...
    rgba[2:4, 2:6, 3] = 255  # ... except an opaque black stroke
    rgba[5, 5] = (255, 0, 0, 128)  # and one half-transparent red pixel
    got = decode_image(_png(Image.fromarray(rgba, "RGBA")), "img")
    want = np.full((8, 10, 3), 255, np.uint8)
    want[2:4, 2:6] = 0
    want[5, 5] = (255, 127, 127)
    np.testing.assert_allclose(got.astype(int), want.astype(int), atol=1)
    pal = Image.fromarray(rgba[..., 3] // 255 * 7).convert("P")  # palette image: index 0 is the transparent colour
    got = decode_image(_png(pal, transparency=0), "img")
    assert (got[0, 0] == 255).all() and (got[2, 2] != 255).any()
    la = Image.fromarray(np.dstack([np.zeros((8, 10), np.uint8), rgba[..., 3]]), "LA")
    got = decode_image(_png(la), "img")
    assert (got[0, 0] == 255).all() and (got[2, 2] == 0).all()
    opaque = _rand(8, 10)  # no transparency: unchanged
    np.testing.assert_array_equal(decode_image(_png(opaque), "img"), opaque)


@pytest.mark.parametrize("fmt", ["PNG", "TIFF"])
def test_16_bit_grey_keeps_its_levels(fmt):
    """A 16-bit greyscale PNG / TIFF (Pillow mode I;16) decoded to white wherever a pixel was above 255/65535:
    convert('RGB') clips.  Its top 8 bits are kept now, as Pillow reads 16-bit RGB."""
    grey = np.array([[0, 255, 256, 30000, 65535], [1000, 20000, 40000, 50000, 65280]], np.uint16)
    buf = io.BytesIO()
    Image.fromarray(grey).save(buf, format=fmt)
    got = decode_image(buf.getvalue(), "img")
    np.testing.assert_array_equal(got, np.repeat((grey >> 8).astype(np.uint8)[..., None], 3, axis=2))


@pytest.mark.parametrize("shape", [(0, 60, 3), (40, 0, 3)])
def test_an_empty_image_is_a_vision_input_error(shape):
    """Model.encode_images / logits(images=) on a 0-pixel-high or -wide array raised ZeroDivisionError (in
    navit_size) instead of the VisionInputError every other malformed image gets."""
    import kimi_jax
    from kimi_jax.modules.vision import VisionInputError, preprocess_image

    cfg = kimi_jax.get_preset("tiny").vision
    with pytest.raises(VisionInputError, match=r"H, W ≥ 1"):
        preprocess_image(np.zeros(shape, np.uint8), cfg)


def test_data_urls_with_line_breaks_or_without_padding_decode():
    """base64 from MIME-style encoders (line breaks every 76 characters: base64.encodebytes, the `base64` tool)
    was refused as 'invalid base64'; browsers read data URLs with forgiving base64 (whitespace ignored, '='
    padding optional, ';BASE64' in any case), and so does the server now.  Other characters are still refused."""
    from kimi_jax.serve.images import load_image

    img = _rand(30, 41)
    raw = _png(img)
    wrapped = base64.encodebytes(raw).decode()
    assert "\n" in wrapped
    for url in ("data:image/png;base64," + wrapped,
                "data:image/png;base64, " + base64.b64encode(raw).decode().rstrip("="),
                "data:image/png;BASE64," + base64.b64encode(raw).decode()):
        np.testing.assert_array_equal(load_image(url, "img"), img)
    with pytest.raises(ImageError, match="base64 payload is invalid"):
        load_image("data:image/png;base64," + base64.b64encode(raw).decode()[:-2] + "@!", "img")


def test_an_unknown_format_says_so_without_an_object_repr():
    """The 400 for bytes Pillow cannot identify read 'cannot identify image file <_io.BytesIO object at 0x7f...>'."""
    with pytest.raises(ImageError) as e:
        decode_image(b"<svg xmlns='http://www.w3.org/2000/svg'/>", "img")
    msg = str(e.value)
    assert "cannot decode the image (not in an image format" in msg and "BytesIO" not in msg and " at 0x" not in msg


@pytest.mark.parametrize("target", ["ftp://127.0.0.1/x.png", "file:///etc/hostname"])
def test_a_redirect_off_http_is_refused(target):
    """urllib's default redirect handler follows a 302 to ftp:// (file:// it refuses itself), though the URL check
    allows only data / http(s): the server must not be steered there."""
    reply = f"HTTP/1.1 302 Found\r\nLocation: {target}\r\nContent-Length: 0\r\n\r\n".encode()
    with _raw_tcp_server(reply) as base:
        with pytest.raises(ImageError, match=FETCH_FAILED):
            load_image(base + "/x.png", "img", ImageFetchConfig(timeout_s=5, allow_private=True))
