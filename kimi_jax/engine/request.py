"""What flows out of the engine to a caller: per-sequence events on a thread-safe stream.

``Engine.submit`` returns a ``RequestStream``.  The engine thread puts, in order, ``SeqEvent``s (one per generated
token of each of the request's ``n`` sequences, interleaved) and finally one ``RequestDone``; if the engine dies, the
stream raises ``EngineDeadError`` instead, and if a step fails while the request is in the engine (the engine then
rebuilds its state and serves on), ``RequestFailedError``; both are ``EngineError``s.  Consume it with ``for ev in stream`` (plain threads) or
``async for ev in stream`` (when submitted with ``loop=``; items are handed over with ``call_soon_threadsafe``).
"""

from __future__ import annotations

import asyncio
import queue
from dataclasses import dataclass, field
from typing import Optional, Union

Piece = Union[str, int]


class EngineError(RuntimeError):
    """No more tokens will come for this request: the engine stopped, or failed while running it."""


class EngineDeadError(EngineError):
    """The engine loop stopped (an error it cannot recover from, or a shutdown); no more tokens will come."""


class RequestFailedError(EngineError):
    """A step of the engine failed while this request was in it: the request ended; the engine rebuilt its state and
    takes new requests again once a probe step runs (``Engine.healthy``)."""


class EngineUnavailableError(EngineError):
    """The engine is rebuilding its state after a failed step and takes no request until it is back."""


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (id, logprob), most likely first; len = the request's top_logprobs


@dataclass
class SeqEvent:
    index: int  # which of the request's n sequences
    token_ids: list[int]  # tokens generated in this event
    pieces: list[Piece]  # new output: text and control-token ids, after stop-string handling
    logprobs: Optional[list[TokenLogprob]] = None
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" when this sequence ended
    stop_reason: Union[str, int, None] = None  # the stop string or stop token id that ended it (None for eos)

    @property
    def text(self) -> str:
        return "".join(p for p in self.pieces if isinstance(p, str))


@dataclass
class RequestDone:
    request_id: str
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens that came from the prefix cache
    num_generated: list[int]  # per sequence
    finish_reasons: list[str]
    arrival_time: float
    first_token_time: Optional[float]
    finish_time: float

    @property
    def num_generated_total(self) -> int:
        return sum(self.num_generated)


@dataclass
class SequenceOutput:
    """A finished sequence, collected from the events (``Engine.generate``)."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    pieces: list[Piece] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: Union[str, int, None] = None

    @property
    def text(self) -> str:
        return "".join(p for p in self.pieces if isinstance(p, str))


class RequestStream:
    def __init__(self, request_id: str, loop: Optional[asyncio.AbstractEventLoop] = None):
        self.request_id = request_id
        self._loop = loop
        self._q = asyncio.Queue() if loop is not None else queue.Queue()
        self.done: Optional[RequestDone] = None

    def put(self, item) -> None:
        """Called by the engine thread."""
        if self._loop is None:
            self._q.put(item)
            return
        try:
            self._loop.call_soon_threadsafe(self._q.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening
            pass

    def _check(self, item):
        if isinstance(item, BaseException):
            raise item
        if isinstance(item, RequestDone):
            self.done = item
        return item

    def __iter__(self):
        if self._loop is not None:
            raise TypeError("this stream was submitted with an event loop; use `async for`")
        while self.done is None:
            yield self._check(self._q.get())

    async def __aiter__(self):
        if self._loop is None:
            raise TypeError("this stream was submitted without an event loop; use `for`")
        while self.done is None:
            yield self._check(await self._q.get())

    def collect(self, n: int) -> tuple[list[SequenceOutput], RequestDone]:
        """Block until the request is done; the n sequences' outputs and the summary."""
        outs = [SequenceOutput(i) for i in range(n)]
        for ev in self:
            if isinstance(ev, SeqEvent):
                apply_event(outs[ev.index], ev)
        return outs, self.done


def apply_event(out: SequenceOutput, ev: SeqEvent) -> None:
    out.token_ids.extend(ev.token_ids)
    out.pieces.extend(ev.pieces)
    if ev.logprobs:
        out.logprobs.extend(ev.logprobs)
    if ev.finish_reason is not None:
        out.finish_reason = ev.finish_reason
        out.stop_reason = ev.stop_reason
