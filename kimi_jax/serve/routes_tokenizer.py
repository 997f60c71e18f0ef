"""The tokenizer endpoints (behind the API key), in the shapes evaluation clients read: /tokenizer_info, /tokenize
(a prompt string or chat messages -> ids) and /detokenize (ids -> text).

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

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool

from .chat_prompt import encode_messages, message_images
from .errors import bad_request
from .protocol import opt_bool, parse_json_body, parse_tools
from .state import ServerState, get_state, require_key

router = APIRouter(dependencies=[Depends(require_key)])


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


@router.get("/tokenizer_info")
async def get_tokenizer_info(st: ServerState = Depends(get_state)):
    return tokenizer_info(st.tokenizer, st.engine.max_model_len)


@router.post("/tokenize")
async def tokenize(request: Request, st: ServerState = Depends(get_state)):
    return await run_in_threadpool(tokenize_body, st, await request.body())


def tokenize_body(st: ServerState, raw: bytes) -> dict:
    """A /tokenize body -> its answer (blocking: runs in a worker thread).  Raises ``APIError``."""
    body = parse_json_body(raw)
    st.check_model(body)
    if "messages" in body:
        if st.chat_format is None:
            raise bad_request("this model has no chat format; tokenize a prompt instead", "messages")
        tools, tool_choice = parse_tools(body)
        opts = st.chat_format.options(body.get("chat_template_kwargs"), body.get("reasoning_effort"))
        _, chat_images = message_images(st, body.get("messages"))
        # as chat completions encodes them: tool_choice "none" leaves the tools out of the prompt
        ids = encode_messages(st, body.get("messages"), tools if tool_choice != "none" else [], opts,
                              opt_bool(body, "add_generation_prompt", True), chat_images)
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise bad_request("'prompt' must be a string (or send 'messages')", "prompt", "invalid_type")
        ids = encode_prompt_text(st.tokenizer, prompt)
    out = {"count": len(ids), "max_model_len": st.engine.max_model_len, "tokens": ids}
    if opt_bool(body, "return_token_strs", False):
        out["token_strs"] = [st.token_str(t) for t in ids]
    return out


@router.post("/detokenize")
async def detokenize(request: Request, st: ServerState = Depends(get_state)):
    return await run_in_threadpool(detokenize_body, st, await request.body())


def detokenize_body(st: ServerState, raw: bytes) -> dict:
    """A /detokenize body -> its answer (blocking: runs in a worker thread).  Raises ``APIError``."""
    body = parse_json_body(raw)
    st.check_model(body)
    ids = body.get("tokens")
    if not isinstance(ids, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
        raise bad_request("'tokens' must be a list of token ids", "tokens", "invalid_type")
    if ids and (min(ids) < 0 or max(ids) >= st.engine.vocab_size):
        raise bad_request(f"token ids must lie in [0, {st.engine.vocab_size})", "tokens")
    return {"prompt": st.tokenizer.decode(ids)}
