"""What a completions choice reports about its prompt: ``echo`` and vLLM's ``prompt_logprobs``.

``/v1/completions`` with ``echo`` and ``logprobs`` reports the prompt's tokens first (the first one's log-prob null,
as OpenAI does), scored by ``engine.prompt_logprobs.PromptScorer``; ``prompt_logprobs`` (vLLM) adds per prompt
position ``{token id: {"logprob", "rank", "decoded_token"}}`` for the prompt token and the k most likely ones.
"""

from __future__ import annotations

from typing import Optional, Sequence

from ..engine.prompt_logprobs import PromptScores
from ..engine.sampling_params import MAX_TOP_LOGPROBS
from .errors import bad_request
from .protocol import opt_int


def parse_prompt_logprobs(body: dict) -> Optional[int]:
    """vLLM's ``prompt_logprobs`` extra: None, or how many most likely tokens to add per prompt position."""
    k = opt_int(body, "prompt_logprobs")
    if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
        raise bad_request(f"prompt_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {k}", "prompt_logprobs")
    return k


class PromptReport:
    """What a completions choice reports about one prompt: the echoed text with each token's offset in it, and
    (when scored) the legacy ``logprobs`` lists and vLLM's ``prompt_logprobs``."""

    def __init__(self, tokenizer, token_str, ids: Sequence[int], skip_special: bool,
                 scores: Optional[PromptScores]):
        self.ids = list(ids)
        self.scores = scores
        self._token_str = token_str
        self._tokenizer = tokenizer
        dec = tokenizer.stream_decoder(skip_special=skip_special)
        offsets, text = [], ""
        for t in self.ids:
            offsets.append(len(text))
            text += dec.push(t)
        text += dec.flush()
        self.text = text
        self.offsets = offsets

    def legacy_logprobs(self, k: int) -> dict:
        """OpenAI's ``logprobs`` object for the prompt tokens: first log-prob null, then the scored ones."""
        s = self.scores
        tok = self._token_str
        token_lps: list = [None] + [float(x) for x in s.logprobs]
        tops: list = [None] + [{tok(int(s.top_ids[t, j])): float(s.top_logprobs[t, j]) for j in range(k)}
                               for t in range(len(s.logprobs))]
        return {"tokens": [tok(t) for t in self.ids], "token_logprobs": token_lps, "top_logprobs": tops,
                "text_offset": list(self.offsets)}

    def prompt_logprobs(self, k: int) -> list:
        """vLLM's ``prompt_logprobs``: None, then per position the prompt token and the k most likely tokens."""
        s = self.scores
        dec = lambda t: self._tokenizer.decode([t])  # noqa: E731
        out: list = [None]
        for t in range(len(s.logprobs)):
            tid = self.ids[t + 1]
            entry = {str(tid): {"logprob": float(s.logprobs[t]), "rank": int(s.ranks[t]), "decoded_token": dec(tid)}}
            for j in range(k):
                other = int(s.top_ids[t, j])
                if str(other) not in entry:
                    entry[str(other)] = {"logprob": float(s.top_logprobs[t, j]), "rank": j + 1,
                                         "decoded_token": dec(other)}
            out.append(entry)
        return out


def merge_logprobs(prompt: Optional[dict], generated: Optional[dict]) -> Optional[dict]:
    """The prompt's legacy logprobs followed by the generated tokens' (either may be None)."""
    if prompt is None:
        return generated
    if generated is None:
        return prompt
    return {key: prompt[key] + generated[key] for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
