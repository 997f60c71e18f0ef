"""Images of chat requests: find the ``image_url`` parts, fetch / decode them into RGB arrays, size their prompt.

A part is ``{"type": "image_url", "image_url": {"url": URL, "detail": ...}}`` (``detail`` is ignored; a bare string
``image_url`` is accepted too).  URLs:

* ``data:image/<type>;base64,<data>`` -- decoded in place;
* ``http://`` / ``https://`` -- fetched with ``http.client`` under ``ImageFetchConfig.timeout_s`` (for the whole
  fetch, redirects included) and ``max_bytes`` (``allow_remote=False`` refuses them: a server that must not reach
  out on a client's behalf).  Against server-side request forgery, the host is resolved once per hop and the
  connection goes to the address that was checked: loopback, private, link-local, shared, multicast, unspecified and
  reserved addresses (in any spelling: ``ipaddress`` judges the resolved address) are refused unless
  ``allow_private``; redirects (at most ``MAX_REDIRECTS``, http(s) only) are followed by hand and checked the same
  way.  Every failure of a fetched image -- refused, unreachable, an HTTP error, too large, not an image -- gives the
  same message, so answers cannot map hosts or ports; the reason is logged.  Environment proxies are not used;
* anything else (``file:``, ``ftp:``, ...) is refused.

Pillow decodes every format it knows (PNG, JPEG, WebP, GIF: first frame, ...); the image is turned upright by its
EXIF orientation, then ``convert("RGB")``-ed (transparency composited onto white, palettes expanded) to uint8
``[H, W, 3]``.  Every failure is an ``ImageError`` whose message names the part and, for a URL, the URL (shortened):
the server turns it into a 400.

Only user messages may carry images (``chat.py`` refuses them elsewhere); ``find_image_urls`` therefore collects the
user messages' parts, in order -- the order ``chat.render_chat_segments`` consumes the ``ChatImage``s in.
"""

from __future__ import annotations

import base64
import binascii
import http.client
import io
import socket
import threading
import ipaddress
import logging
import urllib.parse
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .chat import IMAGE_PART_TYPES, ChatImage, image_part_url
from ..modules.vision import image_token_count, navit_size

log = logging.getLogger("kimi_jax.serve")

__all__ = ["ImageError", "ImageFetchConfig", "chat_image", "decode_image", "find_image_urls", "load_image",
           "load_images"]


class ImageError(ValueError):
    """An image part that cannot be used (bad URL, fetch failure, not an image, too large)."""


@dataclass(frozen=True)
class ImageFetchConfig:
    timeout_s: float = 10.0  # per http(s) fetch
    max_bytes: int = 20 * 1024 * 1024  # encoded size (data URL payload or fetched body)
    max_pixels: int = 64 * 1024 * 1024  # decoded width × height, checked from the header before decoding
    max_images: int = 16  # per request
    allow_remote: bool = True  # fetch http(s) URLs
    allow_private: bool = False  # fetch from loopback / private / link-local / reserved addresses too (trusted use)


def _short(url: str, n: int = 80) -> str:
    return url if len(url) <= n else url[: n - 3] + "..."


def find_image_urls(messages: Any) -> list[tuple[str, str]]:
    """(where, url) of every image part of the user messages, in order.  Malformed messages are left to the chat
    encoder (which names the problem); a malformed image part is an ``ImageError`` here."""
    out = []
    if not isinstance(messages, list):
        return out
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or msg.get("role") != "user" or not isinstance(msg.get("content"), list):
            continue
        for j, part in enumerate(msg["content"]):
            if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES:
                where = f"messages[{i}].content[{j}]"
                try:
                    out.append((where, image_part_url(part, where)))
                except ValueError as e:
                    raise ImageError(str(e)) from None
    return out


_EXIF_ORIENTATION = 0x0112


def _upright(img):
    """``img`` as it is meant to be seen: turned by its EXIF orientation (a phone photo is stored sideways with
    orientation 6 or 8), as browsers and transformers' ``load_image`` (``ImageOps.exif_transpose``) show it.  An
    unreadable EXIF block leaves the pixels as stored."""
    from PIL import ImageOps

    try:
        if img.getexif().get(_EXIF_ORIENTATION, 1) in (1, None):
            return img
        return ImageOps.exif_transpose(img)
    except Exception:  # noqa: BLE001 -- a malformed EXIF block is no reason to refuse the image
        return img


_MODES_16BIT = ("I;16", "I;16L", "I;16B", "I;16N")


def _to_rgb(img):
    """RGB of a decoded image.  16-bit grey keeps its top 8 bits (as Pillow reads 16-bit RGB).  Transparency (an
    alpha band, or a palette / grey image's transparent colour) is composited onto white, as transformers'
    ``convert_to_rgb`` (the K2.5 processor's ``do_convert_rgb``) and vLLM do: dropping the alpha would show the colour
    hidden under transparent pixels, usually black -- black text on a transparent background became a black
    square."""
    from PIL import Image

    if img.mode in _MODES_16BIT:  # 16-bit grey (PNG, TIFF): Pillow's convert clips at 255 -- mid-grey became white
        img = Image.fromarray((np.asarray(img).astype(np.uint32) >> 8).astype(np.uint8), "L")
    if "A" in img.getbands() or "transparency" in img.info:
        rgba = img.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return img.convert("RGB")


def decode_image(data: bytes, what: str, cfg: ImageFetchConfig = ImageFetchConfig()) -> np.ndarray:
    """Encoded image bytes -> uint8 RGB ``[H, W, 3]``."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            w, h = img.size  # from the header: refuse a decompression bomb before decoding it
            if w * h > cfg.max_pixels:
                raise ImageError(f"{what}: the image is {w}x{h} pixels; at most {cfg.max_pixels} pixels are accepted")
            rgb = _to_rgb(_upright(img))
    except ImageError:
        raise
    except Exception as e:  # noqa: BLE001 -- Pillow's decoders report broken data as OSError, but also SyntaxError
        # ("broken PNG file"), struct.error, EOFError, IndexError, ...: every one is the client's unusable image
        # the decoder's own text (a BytesIO repr, internals) goes to the log only
        log.info("%s: the image does not decode: %s: %s", what, type(e).__name__, e)
        reason = ("not in an image format the server reads (PNG, JPEG, GIF, WebP, BMP, TIFF, ...)"
                  if isinstance(e, UnidentifiedImageError) else "the data is damaged or truncated")
        raise ImageError(f"{what}: cannot decode the image ({reason})") from None
    arr = np.asarray(rgb, dtype=np.uint8)
    if arr.ndim != 3 or arr.shape[2] != 3 or min(arr.shape[:2]) < 1:
        raise ImageError(f"{what}: decoded to an array of shape {arr.shape}, not an RGB image")
    return np.ascontiguousarray(arr)


_ASCII_WHITESPACE = str.maketrans("", "", "\t\n\f\r ")


def _data_url_bytes(url: str, what: str, cfg: ImageFetchConfig) -> bytes:
    header, sep, payload = url.partition(",")
    media = header[len("data:"):].split(";")
    if not sep or "base64" not in [m.strip().lower() for m in media[1:]]:
        raise ImageError(f"{what}: a data URL must look like data:image/png;base64,<data>")
    if not media[0].lower().startswith("image/"):
        raise ImageError(f"{what}: data URL media type {media[0]!r} is not an image type (image/png, image/jpeg, ...)")
    if len(payload) * 3 // 4 > cfg.max_bytes:
        raise ImageError(f"{what}: the image is larger than {cfg.max_bytes} bytes")
    # forgiving base64 (WHATWG, as browsers read data URLs): ASCII whitespace is ignored -- MIME-style encoders
    # (base64.encodebytes, `base64` without -w0) break lines every 76 characters -- and the '=' padding is optional
    payload = payload.translate(_ASCII_WHITESPACE)
    if len(payload) % 4:
        payload += "=" * (-len(payload) % 4)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"{what}: the data URL's base64 payload is invalid") from None


class _Deadline:
    """The whole-fetch time limit: when it passes, every socket the fetch opened (redirects included) is shut down,
    so a blocked read returns at once.  (A socket timeout alone bounds each read, not the fetch: a server that
    trickles a byte every few seconds would hold the request -- and a worker thread -- for hours.)"""

    def __init__(self, seconds: float):
        self.expired = False
        self._socks: list = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    def __enter__(self) -> "_Deadline":
        self._timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self._timer.cancel()

    def add(self, sock) -> None:
        with self._lock:
            if not self.expired:
                self._socks.append(sock)
                return
        self._shut(sock)

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            socks, self._socks = self._socks, []
        for sock in socks:
            self._shut(sock)

    @staticmethod
    def _shut(sock) -> None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class _FetchFailed(Exception):
    """Why a fetch failed, for the server's log only: the client always gets the same text (``_fetch``)."""


MAX_REDIRECTS = 5
_REDIRECTS = (301, 302, 303, 307, 308)
_NAT64 = ipaddress.ip_network("64:ff9b::/96")  # an IPv4 address inside an IPv6 one, translated by a NAT64 gateway

_getaddrinfo = socket.getaddrinfo  # module level, so tests can resolve names without DNS


def is_public_address(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether ``ip`` is a globally routable unicast address: not loopback, private, link-local, shared (CGNAT),
    multicast, unspecified or reserved -- also when written inside an IPv6 address (IPv4-mapped ``::ffff:a.b.c.d``,
    NAT64 ``64:ff9b::a.b.c.d``, 6to4 ``2002:...``); Teredo tunnels are refused outright."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return is_public_address(ip.ipv4_mapped)
        if ip in _NAT64:
            return is_public_address(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
        if ip.sixtofour is not None and not is_public_address(ip.sixtofour):
            return False
        if ip.teredo is not None:
            return False
    return ip.is_global and not (ip.is_loopback or ip.is_private or ip.is_link_local or ip.is_multicast
                                 or ip.is_unspecified or ip.is_reserved)


def _resolve(host: str, port: int, allow_private: bool) -> tuple:
    """The address to connect to for ``host``: resolved once here and checked, so the connection goes to the
    address that was checked (a DNS answer that changes between check and connect cannot win).  Every address the
    name resolves to must be public unless ``allow_private``."""
    try:
        infos = _getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        raise _FetchFailed(f"cannot resolve {host!r}: {e}") from None
    if not infos:
        raise _FetchFailed(f"{host!r} resolves to no address")
    for *_, sockaddr in infos:
        ip = ipaddress.ip_address(sockaddr[0].split("%", 1)[0])
        if not allow_private and not is_public_address(ip):
            raise _FetchFailed(f"{host!r} resolves to {ip}, which is not a public address")
    family, kind, proto, _, sockaddr = infos[0]
    return family, kind, proto, sockaddr


def _connection(url: str, cfg: ImageFetchConfig, deadline: _Deadline) -> tuple[http.client.HTTPConnection, str]:
    """An http.client connection for ``url`` that connects to its checked address (``_resolve``) while the Host
    header and TLS (SNI, certificate) use the URL's host name; and the request target (path + query)."""
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise _FetchFailed(f"scheme {scheme!r} is not http(s)")
    host = parts.hostname
    if not host:
        raise _FetchFailed("no host")
    port = parts.port or (443 if scheme == "https" else 80)  # ValueError for a bad port: a failure like any other
    family, kind, proto, sockaddr = _resolve(host, port, cfg.allow_private)

    def connect(_address, timeout, source_address=None):
        sock = socket.socket(family, kind, proto)
        deadline.add(sock)
        try:
            sock.settimeout(timeout)
            sock.connect(sockaddr)
        except BaseException:
            sock.close()
            raise
        return sock

    cls = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
    conn = cls(host, port, timeout=cfg.timeout_s)
    conn._create_connection = connect  # http.client's documented-by-use hook for how the socket is made
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    return conn, target


def _get(url: str, cfg: ImageFetchConfig, deadline: _Deadline) -> bytes:
    """GET ``url``, following up to ``MAX_REDIRECTS`` http(s) redirects by hand (each hop resolved and checked
    again), and read at most ``cfg.max_bytes`` + 1 bytes of the body."""
    for _ in range(MAX_REDIRECTS + 1):
        conn, target = _connection(url, cfg, deadline)
        try:
            conn.request("GET", target, headers={"User-Agent": "kimi_jax-server", "Accept": "image/*"})
            resp = conn.getresponse()
            if resp.status in _REDIRECTS and resp.getheader("Location"):
                url = urllib.parse.urljoin(url, resp.getheader("Location"))
                continue
            if resp.status != 200:
                raise _FetchFailed(f"HTTP {resp.status} {resp.reason}")
            data = bytearray()
            while len(data) <= cfg.max_bytes:
                chunk = resp.read1(min(1 << 16, cfg.max_bytes + 1 - len(data)))
                if not chunk:
                    break
                data += chunk
            return bytes(data)
        finally:
            conn.close()
    raise _FetchFailed(f"more than {MAX_REDIRECTS} redirects")


def _fetch_failed(what: str, url: str) -> ImageError:
    """The one answer to every failure of a fetched image -- refused destination, DNS, connection, timeout, HTTP
    status, size, undecodable bytes -- so that the answers cannot tell a client which hosts or ports exist."""
    return ImageError(f"{what}: could not load an image from {_short(url)}")


def _fetch(url: str, what: str, cfg: ImageFetchConfig) -> bytes:
    if not cfg.allow_remote:
        raise ImageError(f"{what}: this server does not fetch image URLs ({_short(url)}); send a data URL")
    with _Deadline(cfg.timeout_s) as deadline:
        try:
            data = _get(url, cfg, deadline)
        except (_FetchFailed, OSError, ValueError, http.client.HTTPException) as e:
            # refused destination, DNS, connection refused, timeout, a malformed URL, a reply that is not HTTP, a
            # body cut short: the reason goes to the log only
            reason = "timed out" if deadline.expired else f"{type(e).__name__}: {e}"
            log.info("%s: fetching %s failed: %s", what, _short(url), reason)
            raise _fetch_failed(what, url) from None
        if deadline.expired:  # the shut-down socket ended the body early
            log.info("%s: fetching %s failed: timed out after %g s", what, _short(url), cfg.timeout_s)
            raise _fetch_failed(what, url)
    if len(data) > cfg.max_bytes:
        log.info("%s: %s is larger than %d bytes", what, _short(url), cfg.max_bytes)
        raise _fetch_failed(what, url)
    return data


def load_image(url: str, what: str, cfg: ImageFetchConfig = ImageFetchConfig()) -> np.ndarray:
    """One image part's URL -> uint8 RGB ``[H, W, 3]`` (blocking: http(s) URLs are fetched)."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        data = _data_url_bytes(url, what, cfg)
        return decode_image(data, what, cfg)
    if scheme in ("http", "https"):
        data = _fetch(url, what, cfg)
        try:
            return decode_image(data, f"{what} ({_short(url)})", cfg)
        except ImageError as e:  # what a fetched body decodes to is part of the one answer too
            log.info("%s", e)
            raise _fetch_failed(what, url) from None
    raise ImageError(f"{what}: unsupported image URL scheme {scheme or url[:20]!r} ({_short(url)}); use a "
                     "data:image/...;base64 URL or http(s)")


def load_images(urls: Sequence[tuple[str, str]], cfg: ImageFetchConfig = ImageFetchConfig()) -> list[np.ndarray]:
    """``find_image_urls``' list -> the decoded images, in order (blocking; run it off the event loop)."""
    if len(urls) > cfg.max_images:
        raise ImageError(f"the messages hold {len(urls)} images; at most {cfg.max_images} per request")
    return [load_image(url, where, cfg) for where, url in urls]


def chat_image(image_hw3: np.ndarray, vision_cfg) -> ChatImage:
    """The prompt's view of a decoded image: original width × height and its token count on this vision tower
    (the size ``preprocess_image`` resizes and pads it to: (padded h / 28) · (padded w / 28) tokens)."""
    h, w = int(image_hw3.shape[0]), int(image_hw3.shape[1])
    _, (pad_h, pad_w) = navit_size(h, w, vision_cfg)
    p = vision_cfg.patch_size
    return ChatImage(w, h, image_token_count([(1, pad_h // p, pad_w // p)], vision_cfg.merge))
