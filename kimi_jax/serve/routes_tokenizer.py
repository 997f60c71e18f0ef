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
"""

from __future__ import annotations

from typing import Optional

from fastapi import APIRouter


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
