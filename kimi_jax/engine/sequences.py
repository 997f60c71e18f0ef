"""The engine's records of work in flight: a ``_Request`` is built by ``Engine.submit``, everything else on the
engine thread, and only the engine thread changes them (other threads read a request's ``seqs`` / ``done``).

``_Request``: one submitted request (its ``n`` sequences share a prompt, a stream and one prefill).  ``_Seq``: one
sequence of it, in a cache slot while running (``slot`` None while preempted).  ``_Prefill``: a prefill in progress
(a new request or a preempted sequence's recompute).  ``_Context``: a sequence's prompt + output as one read-only
token sequence, what proposers draft from.  ``_request_of``: the request of a waiting-queue entry.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

from .detok import OutputText
from .guide import Guide
from .images import PromptImages
from .request import RequestStream
from .sampling_params import SamplingParams


@dataclass(eq=False)  # identity: sequences sit in deques / dicts
class _Seq:
    req: "_Request"
    index: int
    slot: Optional[int]  # None while preempted
    pending: deque  # tokens still to feed; emission starts once only one is left
    text: OutputText
    guide: Optional[Guide]
    output_ids: list = field(default_factory=list)
    finish_reason: Optional[str] = None
    fed: int = 0  # tokens in the cache (the next decode step writes position `fed`)
    order: int = 0  # admission order: the largest is the youngest (first to be preempted)
    preemptions: int = 0

    @property
    def key(self):
        """Its id in the block allocator."""
        return (self.req.request_id, self.index)


@dataclass(eq=False)
class _Request:
    request_id: str
    prompt_ids: list
    params: SamplingParams
    n: int
    stream: RequestStream
    guide_factory: Optional[Callable[[], Guide]]
    seed: int
    arrival: float
    seqs: list = field(default_factory=list)
    cached_tokens: int = 0
    images: Optional[PromptImages] = None
    waited_for_vision: bool = False  # logged once that it waits for a tower compile
    first_token_time: Optional[float] = None
    aborted: bool = False
    done: bool = False


@dataclass(eq=False)
class _Prefill:
    """A prefill in progress: a new request (its ``n`` sequences share it) or a preempted sequence's recompute."""

    req: _Request
    ids: list  # every token the sequence(s) will have fed: the prompt (+ the generated tokens on a resume)
    seq: Optional[_Seq]  # the resumed sequence; None for a new request
    keys: list  # allocator ids of the sequences; keys[0]'s pages receive the prefill
    slots: list
    order: int
    chunks: list  # prefill chunk sizes still to run
    key: list = field(default_factory=list)  # ids as the prefix cache sees them (image tokens by pixel digest)
    pos: int = 0  # tokens already in cache1 / keys[0]'s pages
    prefill_len: int = 0  # tokens in cache1 / keys[0]'s pages once the chunks have run (the rest ride the decode steps)
    checkpoints: set = field(default_factory=set)  # positions at which a chunk ends and a prefix checkpoint is taken
    cache1: object = None


class _Context:
    """A sequence's tokens, prompt then output, as one read-only sequence without copying either list."""

    def __init__(self, prompt: list, output: list):
        self.prompt, self.output = prompt, output

    def __len__(self) -> int:
        return len(self.prompt) + len(self.output)

    def __getitem__(self, i):
        P = len(self.prompt)
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step != 1:
                raise ValueError("a step is not supported")
            return self.prompt[start:min(stop, P)] + self.output[max(start - P, 0):max(stop - P, 0)]
        if i < 0:
            i += len(self)
        return self.prompt[i] if i < P else self.output[i - P]


def _request_of(item) -> _Request:
    """The request of a waiting queue entry: a new request, or a preempted sequence's."""
    return item.req if isinstance(item, _Seq) else item

