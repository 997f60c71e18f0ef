"""What one request asks of the sampler and the stop logic, validated once at submission.

Every field has the meaning of the OpenAI / vLLM parameter of the same name:

* ``temperature`` 0 means greedy (argmax after penalties, bias and constraints); ``top_p``, ``top_k`` (0 = off),
  ``min_p`` filter the temperature-scaled distribution; ``seed`` makes sampling reproducible per request (the random
  stream of a sequence depends only on (seed, choice index, step), never on the batch it ran in).
* ``presence_penalty`` / ``frequency_penalty`` (OpenAI, on generated tokens) subtract ``p·[count>0]`` and
  ``f·count``; ``repetition_penalty`` (vLLM / CTRL, on prompt and generated tokens) divides positive logits and
  multiplies negative ones.
* ``logit_bias`` ``{token id: bias in [-100, 100]}`` is added to the logits before everything else.
* ``logprobs`` returns the log-probability of each sampled token and ``top_logprobs`` (≤ ``MAX_TOP_LOGPROBS``) the
  most likely alternatives, both from the model's raw distribution (``log_softmax`` of the logits, before
  temperature, penalties, bias and constraints -- vLLM's "raw_logprobs").
* ``stop`` strings end the output where they first appear (the stop string itself is cut unless
  ``include_stop_str_in_output``); ``stop_token_ids`` add to the tokenizer's end-of-turn ids; ``ignore_eos`` keeps
  going past end-of-turn tokens; ``min_tokens`` forbids the tokenizer's end-of-turn ids until that many tokens
  exist (``stop_token_ids`` and stop strings still end the output earlier).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 300
MAX_STOP_STRINGS = 16
SEED_MIN, SEED_END = -2 ** 63, 2 ** 63  # a seed is a signed 64-bit integer: larger ones would be silently folded


class ParamError(ValueError):
    """A bad request parameter; ``param`` names it (the server turns this into a 400 with ``param`` set)."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    logprobs: bool = False
    top_logprobs: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0

    def replace(self, **changes) -> "SamplingParams":
        return dataclasses.replace(self, **changes)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int) -> "SamplingParams":
        """Raise ``ParamError`` naming the first bad field; returns self for chaining."""
        _int_at_least(self.max_tokens, 1, "max_tokens")
        _finite_between(self.temperature, 0.0, 2.0, "temperature")
        _finite_between(self.top_p, 0.0, 1.0, "top_p")
        if self.top_p <= 0.0:
            raise ParamError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        _int_at_least(self.top_k, 0, "top_k")
        _finite_between(self.min_p, 0.0, 1.0, "min_p")
        if self.seed is not None and (not _is_int(self.seed) or not SEED_MIN <= self.seed < SEED_END):
            raise ParamError(f"seed must be an integer in [-2**63, 2**63) (a signed 64-bit integer, as "
                             f"Model.generate takes), got {self.seed!r}", "seed")
        _finite_between(self.presence_penalty, -2.0, 2.0, "presence_penalty")
        _finite_between(self.frequency_penalty, -2.0, 2.0, "frequency_penalty")
        _finite_between(self.repetition_penalty, 0.0, 10.0, "repetition_penalty")
        if self.repetition_penalty <= 0.0:
            raise ParamError(f"repetition_penalty must be > 0, got {self.repetition_penalty}", "repetition_penalty")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ParamError(f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS}", "logit_bias")
        for tid, bias in self.logit_bias.items():
            if not _is_int(tid) or not 0 <= tid < vocab_size:
                raise ParamError(f"logit_bias token id {tid!r} is not in [0, {vocab_size})", "logit_bias")
            _finite_between(bias, -100.0, 100.0, "logit_bias")
        if not isinstance(self.logprobs, bool):
            raise ParamError("logprobs must be a boolean", "logprobs")
        _int_at_least(self.top_logprobs, 0, "top_logprobs")
        if self.top_logprobs > MAX_TOP_LOGPROBS:
            raise ParamError(f"top_logprobs must be at most {MAX_TOP_LOGPROBS}, got {self.top_logprobs}",
                             "top_logprobs")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ParamError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}", "stop")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ParamError("stop strings must be non-empty strings", "stop")
        for tid in self.stop_token_ids:
            if not _is_int(tid) or not 0 <= tid < vocab_size:
                raise ParamError(f"stop_token_ids entry {tid!r} is not in [0, {vocab_size})", "stop_token_ids")
        _int_at_least(self.min_tokens, 0, "min_tokens")
        if self.min_tokens > self.max_tokens:
            raise ParamError(f"min_tokens ({self.min_tokens}) exceeds max_tokens ({self.max_tokens})", "min_tokens")
        return self


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _int_at_least(x, lo: int, name: str) -> None:
    if not _is_int(x) or x < lo:
        raise ParamError(f"{name} must be an integer >= {lo}, got {x!r}", name)


def _finite_between(x, lo: float, hi: float, name: str) -> None:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not lo <= x <= hi or not math.isfinite(x):
        # the range test first: math.isfinite overflows on an int too large for a float
        raise ParamError(f"{name} must be a number in [{lo:g}, {hi:g}], got {repr(x)[:40]}", name)


def as_stop_tuple(stop: Optional[str | Sequence[str]]) -> tuple[str, ...]:
    """OpenAI's ``stop`` (a string, a list of strings or null) as a tuple."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop):
        return tuple(stop)
    raise ParamError("stop must be a string or a list of strings", "stop")
