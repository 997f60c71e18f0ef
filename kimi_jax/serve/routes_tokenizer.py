"""Tokenizer endpoints and prompt log-probs in the shapes evaluation clients read.

``GET /tokenizer_info`` answers as vLLM's does (``tokenizer_class``, the special tokens as strings, the
control-token table as ``added_tokens_decoder``, ``model_max_length``, ``chat_template``): lm-evaluation-harness's
``RemoteTokenizer`` (``tokenizer_backend=remote``) reads ``eos_token`` / ``bos_token`` / ``pad_token`` there and
then asks ``/tokenize`` for their ids.  ``chat_template`` is null: prompts are built as token segments
(``chat.py``), never from a Jinja template -- a client that wants the chat format sends messages to
``/v1/chat/completions`` (lm-eval's ``local-chat-completions``) or to ``/tokenize``.

Text never yields control tokens (``Tokenizer.encode``), with one exception here: a ``/tokenize`` prompt that is
exactly one control token's name is that token -- how a remote tokenizer learns the id of the ``eos_token`` string
it was given.  A control-token name inside longer text stays text.

``/v1/completions`` with ``echo`` and ``logprobs`` reports the prompt's tokens first (the first one's log-prob null,
as OpenAI does), scored by ``engine.prompt_logprobs.PromptScorer``; ``prompt_logprobs`` (vLLM) adds per prompt
position ``{token id: {"logprob", "rank", "decoded_token"}}`` for the prompt token and the k most likely ones.
"""

from __future__ import annotations

from typing import Optional, Sequence

from fastapi import APIRouter

from ..engine.prompt_logprobs import PromptScores
from ..engine.sampling_params import MAX_TOP_LOGPROBS
from .errors import bad_request
from .protocol import opt_int


def encode_prompt_text(tokenizer, text: str) -> list[int]:
    """``/tokenize``'s text -> ids: the control token itself when ``text`` is exactly its name, else BPE ids."""
    if text in tokenizer.special_tokens:
        return [tokenizer.special_tokens[text]]
    return tokenizer.encode(text)


def tokenizer_info(tokenizer, max_model_len: int) -> dict:
    special = tokenizer.special_tokens

    def name(tid: Optional[int]) -> Optional[str]:
        return None if tid is None else tokenizer.special_name(tid)

    return {
        "tokenizer_class": "TikTokenTokenizer",
        "eos_token": name(tokenizer.eos_id),
        "bos_token": name(tokenizer.bos_id),
        "pad_token": name(tokenizer.pad_id),
        "unk_token": name(special.get("[UNK]")),
        "model_max_length": max_model_len,
        "vocab_size": tokenizer.vocab_size,
        "added_tokens_decoder": {str(i): {"content": n, "special": True} for n, i in special.items()},
        "chat_template": None,
    }


def add_tokenizer_routes(router: APIRouter, tokenizer, max_model_len: int) -> None:
    info = tokenizer_info(tokenizer, max_model_len)

    @router.get("/tokenizer_info")
    async def get_tokenizer_info():
        return info


# ---------------------------------------------------------------------------------------------- completions echo
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
