"""One engine + live uvicorn server per test process, shared by test_engine.py and test_serve.py.

Compiling the engine programs of the tiny model takes ~25 s on 2 CPU cores, so both files use the same engine
(built on conftest's session ``tiny_model``) and the same server (a uvicorn thread on a free 127.0.0.1 port).
``shared(tiny_model)`` is memoised at module level because a session fixture defined in two test modules would
otherwise be built twice.
"""

from __future__ import annotations

import atexit
from types import SimpleNamespace

MAX_NUM_SEQS = 32
MAX_MODEL_LEN = 512
PREFILL_CHUNKS = (64, 16)
GUIDED_STRING_MAX_TOKENS = 6

_shared = {}


def shared(tiny_model) -> SimpleNamespace:
    if "ns" in _shared:
        return _shared["ns"]
    from kimi_jax.engine import Engine, EngineConfig
    from kimi_jax.serve.app import build_app
    from kimi_jax.serve.images import ImageFetchConfig
    from kimi_jax.serve.server import ServerThread
    from kimi_jax.tokenizer import Tokenizer

    tok = Tokenizer.tiny()
    engine = Engine(tiny_model, tok, EngineConfig(max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN,
                                                  prefill_chunk_sizes=PREFILL_CHUNKS))
    engine.start()
    # the random model never closes a string argument of a forced tool call by itself: cap them short
    # the image tests fetch from HTTP servers on loopback, which a default server refuses (SSRF): allowed here
    app = build_app(engine, tok, model_name="tiny", guided_string_max_tokens=GUIDED_STRING_MAX_TOKENS,
                    image_fetch=ImageFetchConfig(allow_private=True))
    server = ServerThread(app).start()

    def stop():
        server.stop()
        engine.shutdown()

    atexit.register(stop)
    ns = SimpleNamespace(engine=engine, tokenizer=tok, server=server, url=server.url, base_url=server.url + "/v1",
                         model=tiny_model)
    _shared["ns"] = ns
    return ns
