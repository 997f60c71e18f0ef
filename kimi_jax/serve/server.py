"""Loading a model for serving, and running the app with uvicorn in a background thread (tests, benchmarks)."""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Optional

from ..checkpoint import load_model, preflight, random_mxfp4_model
from ..config import get_preset
from ..kernels import KernelConfig
from ..model import MAX_RANDOM_PARAMS, Model, abstract_params, is_routed_expert
from ..modules.decoder import KimiForCausalLM
from ..tokenizer import Tokenizer
from .formats import tokenizer_family

log = logging.getLogger("kimi_jax.serve")


def load_for_serving(checkpoint: Optional[str] = None, preset: Optional[str] = None, *, dtype=None, seed: int = 0,
                     mesh=None, max_model_len: Optional[int] = None, random_experts: str = "dense"):
    """(model, tokenizer, default served name).  No checkpoint: the ``preset`` (default ``tiny``) with random
    weights and the built-in tokenizer (``Tokenizer.tiny``; for a full-size vocabulary its 1000 ranks with every
    other id a reserved control token, which a benchmark's id prompts do not mind), the routed experts drawn as
    ``random_experts`` ("dense", or "mxfp4": `checkpoint.random_mxfp4_model`, what fits a real-size model on one
    GPU).  ``mesh``: a ``jax.sharding.Mesh`` the parameters are placed on (``sharding.rules``), or None for one
    device.

    A checkpoint is checked before its weights are read (``checkpoint.preflight``: config, parts / weight files),
    its tokenizer loaded first (a missing ``tiktoken.model`` fails in seconds, not after the weights), and
    ``max_model_len`` (when given) held against the config.  Raises ``ValueError`` / ``FileNotFoundError``."""
    if checkpoint:
        cfg = preflight(checkpoint)
        tokenizer = Tokenizer.from_dir(checkpoint, family=tokenizer_family(cfg.architecture))
        if tokenizer.vocab_size > cfg.vocab_size:
            raise ValueError(f"the tokenizer has {tokenizer.vocab_size} ids but the model's vocabulary only "
                             f"{cfg.vocab_size}")
        if max_model_len is not None and not 2 <= max_model_len <= cfg.max_position_embeddings:
            raise ValueError(f"--max-model-len {max_model_len} is outside [2, {cfg.max_position_embeddings}] (the "
                             "model's max_position_embeddings)")
        model = load_model(checkpoint, dtype=dtype, mesh=mesh)
        return model, tokenizer, checkpoint
    name = preset or "tiny"
    cfg = get_preset(name)
    tiny = Tokenizer.tiny(tokenizer_family(cfg.architecture))
    if cfg.vocab_size != tiny.vocab_size:
        tiny = Tokenizer.tiny(tokenizer_family(cfg.architecture), vocab_size=cfg.vocab_size)
        log.info("preset %s has a %d-id vocabulary: the built-in tokenizer's %d BPE ranks serve it, every other id "
                 "is a reserved control token (random weights: for benchmarks)", name, cfg.vocab_size,
                 tiny.num_ranks)
    model = _random_preset(name, cfg, dtype=dtype, seed=seed, mesh=mesh, experts=random_experts)
    return model, tiny, name


def load_draft_model(checkpoint_or_preset: str, *, dtype=None, seed: int = 0):
    """The draft model for speculative decoding (`--speculative-model`): a checkpoint directory, or a preset with
    random weights drawn from `seed`, on the default device (a draft model is small; it is not placed on a mesh)."""
    import os

    if os.path.isdir(checkpoint_or_preset):
        return load_model(checkpoint_or_preset, dtype=dtype)
    return _random_preset(checkpoint_or_preset, get_preset(checkpoint_or_preset), dtype=dtype, seed=seed, mesh=None)


def _random_preset(name: str, cfg, *, dtype, seed: int, mesh, experts: str = "dense"):
    """``load_model(preset)``, and beyond its cap on random-weight models when the weights fit the accelerator.

    ``load_model`` refuses presets above ``MAX_RANDOM_PARAMS`` so that nobody materialises a 2.8T-parameter model
    by accident.  The server can check the real limit instead: a benchmark model such as ``kimi-k3.1-reduced``
    (full width, a few layers, ~18B parameters) fits one H200 comfortably.  The weights are drawn on the first
    device (then placed on the mesh), so that device's memory is what must hold them, with a quarter spare for the
    float32 draw of the largest tensor and the engine's caches.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    from flax import nnx

    dt = jnp.dtype(dtype) if dtype is not None else jnp.dtype(jnp.float32)
    if experts not in ("dense", "mxfp4"):
        raise ValueError(f"random experts must be 'dense' or 'mxfp4', got {experts!r}")
    shapes = abstract_params(cfg, dt)
    count = sum(int(np.prod(a.shape)) for a in shapes.values())
    if count <= MAX_RANDOM_PARAMS and experts == "dense":
        return load_model(name, dtype=dt, seed=seed, mesh=mesh)
    # MXFP4: 4.25 bits a weight (a 4-bit code, an 8-bit scale per 32)
    nbytes = sum(int(np.prod(a.shape)) * (4.25 / 8 if experts == "mxfp4" and is_routed_expert(n) else a.dtype.itemsize)
                 for n, a in shapes.items())
    stats = (jax.devices()[0].memory_stats() or {}) if jax.devices()[0].platform != "cpu" else {}
    limit = stats.get("bytes_limit", 0)
    if nbytes * 1.25 > limit and (limit or count > MAX_RANDOM_PARAMS):  # a small model on a CPU host: no check
        where = f"{limit / 2**30:.0f} GiB of {jax.devices()[0]}" if limit else "a CPU host (no random models "\
                f"above {MAX_RANDOM_PARAMS / 1e9:.0f}B parameters there)"
        raise ValueError(f"preset {name!r} has {count / 1e9:.1f}B parameters ({nbytes / 2**30:.1f} GiB as {dt.name}): "
                         f"too large for random weights on {where}; serve a checkpoint instead")
    log.info("preset %s: %.1fB parameters (%.1f GiB as %s%s), drawing them on %s", name, count / 1e9, nbytes / 2**30,
             dt.name, ", routed experts MXFP4" if experts == "mxfp4" else "", jax.devices()[0])
    if experts == "mxfp4":
        return random_mxfp4_model(cfg, seed=seed, dtype=dt, mesh=mesh)
    module = KimiForCausalLM(cfg, rngs=nnx.Rngs(seed), dtype=dt)
    return Model(module, dt, mesh=mesh, kernels=KernelConfig())


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
