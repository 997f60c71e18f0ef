"""What the chat and completions answers share: the OpenAI ``usage`` object and server-sent events (a chunk, the
closing error chunk, and a streaming response that stops as soon as the client leaves)."""

from __future__ import annotations

import json

import anyio
from fastapi.responses import StreamingResponse

from ..engine import EngineError
from .engine_errors import engine_api_error


class SSEResponse(StreamingResponse):
    """A streaming response that always listens for the client's disconnect and cancels the body iterator then
    (whatever ASGI spec version the server speaks), so the iterator's ``finally`` runs at once."""

    async def __call__(self, scope, receive, send):
        async with anyio.create_task_group() as tg:
            async def run():
                try:
                    await self.stream_response(send)
                except OSError:
                    pass
                finally:
                    tg.cancel_scope.cancel()

            tg.start_soon(run)
            await self.listen_for_disconnect(receive)
            tg.cancel_scope.cancel()


def sse(obj) -> str:
    """One server-sent event carrying ``obj`` as compact JSON."""
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


def sse_error(e: EngineError) -> str:
    """A stream's last words when the engine cannot finish it: an OpenAI error chunk, then ``[DONE]``."""
    err = engine_api_error(e)
    return sse(err.body()) + "data: [DONE]\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict:
    """OpenAI's ``usage``, with the prompt tokens the prefix cache served as ``cached_tokens``."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}
