"""Loading a model for serving, and running the app with uvicorn in a background thread (tests, benchmarks)."""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Optional

log = logging.getLogger("kimi_jax.serve")


def load_for_serving(checkpoint: Optional[str] = None, preset: Optional[str] = None, *, dtype=None, seed: int = 0):
    """(model, tokenizer, default served name).  No checkpoint: the ``preset`` (default ``tiny``) with random
    weights; a preset whose vocabulary is the tiny one gets ``Tokenizer.tiny()``."""
    from .. import load_model
    from ..tokenizer import Tokenizer
    from .formats import tokenizer_family

    if checkpoint:
        model = load_model(checkpoint, dtype=dtype)
        family = tokenizer_family(model.config.architecture)
        tokenizer = Tokenizer.from_dir(checkpoint, family=family)
        return model, tokenizer, checkpoint
    name = preset or "tiny"
    model = load_model(name, dtype=dtype, seed=seed)
    family = tokenizer_family(model.config.architecture)
    tiny = Tokenizer.tiny(family)
    if model.config.vocab_size != tiny.vocab_size:
        raise ValueError(f"preset {name!r} has a {model.config.vocab_size}-token vocabulary and no tokenizer ships with "
                         "it; serve a checkpoint directory (with tiktoken.model) instead")
    return model, tiny, name


class ServerThread:
    """uvicorn serving ``app`` from a daemon thread on ``host:port`` (port 0: a free one, bound before start)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn

        self.host = host
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.port = self._sock.getsockname()[1]
        config = uvicorn.Config(app, log_level=log_level, lifespan="off", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                        name="kimi-jax-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self._thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError("uvicorn exited during start-up")
            if time.monotonic() - t0 > timeout:
                raise TimeoutError("uvicorn did not start in time")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)
        try:
            self._sock.close()
        except OSError:
            pass
