"""POST /v1/completions (behind the API key): text completion of one or several prompts.

``prompt`` is a string, a list of strings, token ids or lists of ids; each prompt is its own engine request
(``{id}-{k}``) and its ``n`` choices are numbered ``k * n + i``.  ``echo`` puts the prompt's text first (with its
tokens' log-probs when ``logprobs`` is set) and vLLM's ``prompt_logprobs`` adds a per-position report
(``prompt_report.py``); with ``max_tokens`` 0 only that report is answered, nothing is generated.  A stream
interleaves the prompts' events as they come.  A client that leaves aborts every prompt's request.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Optional

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool

from ..engine import EngineError, RequestDone
from ..engine.request import SequenceOutput, apply_event
from .engine_errors import engine_api_error
from .errors import bad_request
from .prompt_report import PromptReport, merge_logprobs, parse_prompt_logprobs
from .protocol import opt_bool, parse_common, parse_json_body
from .responses import SSEResponse, sse, sse_error, usage
from .state import ServerState, get_state, require_key
from .structured import StructuredGuideBuilder, request_grammar

log = logging.getLogger("kimi_jax.serve")

router = APIRouter(dependencies=[Depends(require_key)])


@dataclass
class CompletionPlan:
    """A prepared completions request (``prepare_completion``): (ids, SamplingParams) per prompt."""

    prompts: list
    c: Any
    echo_texts: list[str]
    skip_special: bool
    reports: list = None  # a prompt_report.PromptReport per prompt when echo / prompt_logprobs ask for one
    echo_logprobs: bool = False  # the choices' logprobs start with the prompt's tokens
    prompt_k: Optional[int] = None  # vLLM's prompt_logprobs
    generate: bool = True  # False for max_tokens 0: the prompt is reported, nothing is generated
    guide_factory: Any = None  # structured output (``structured.py``)


@router.post("/v1/completions")
async def completions(request: Request, st: ServerState = Depends(get_state)):
    st.check_ready()  # refused before the body is read and prepared
    plan = await run_in_threadpool(prepare_completion, st, await request.body())
    c = plan.c
    rid = "cmpl-" + uuid.uuid4().hex
    created = int(time.time())
    if not plan.generate:  # max_tokens 0: the prompt only
        if c.stream:
            return SSEResponse(prompt_only_stream(st, plan, rid, created), media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache"})
        return prompt_only_response(st, plan, rid, created)
    rids = [f"{rid}-{k}" for k in range(len(plan.prompts))]
    streams = []
    try:
        for (ids, params), sub_id in zip(plan.prompts, rids):
            streams.append(st.submit(ids, params, c.n, sub_id, plan.guide_factory))
    except Exception:  # a later prompt refused: the ones already submitted must not run on unseen
        for sub_id in rids[:len(streams)]:
            st.engine.abort(sub_id)
        raise
    st.drain.track(rid, streams, rids)
    if c.stream:
        return SSEResponse(completion_stream(st, streams, rids, rid, created, c, plan),
                           media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return await completion_full(st, request, streams, rids, rid, created, c, plan)


def prepare_completion(st: ServerState, raw: bytes) -> CompletionPlan:
    """A completions request body -> its prompts (token ids, sampling params each), checked (blocking: runs
    in a worker thread).  Raises ``APIError``."""
    engine, tokenizer = st.engine, st.tokenizer
    body = parse_json_body(raw)
    st.check_model(body)
    mt = body.get("max_tokens")
    generate = not (isinstance(mt, (int, float)) and not isinstance(mt, bool) and mt == 0)
    if not generate:  # checked as 1 below; nothing is generated
        body = dict(body, max_tokens=1)
    c = parse_common(body, vocab_size=engine.vocab_size, chat=False, max_n=engine.B)
    prompts = parse_prompts(st, body.get("prompt"))
    echo = opt_bool(body, "echo", False)
    prompt_k = parse_prompt_logprobs(body)
    grammar = request_grammar(body)
    if not generate and not echo and prompt_k is None:
        raise bad_request("max_tokens 0 generates nothing: it needs echo (or prompt_logprobs)", "max_tokens")
    if body.get("suffix") is not None:
        raise bad_request("suffix is not supported", "suffix", "unsupported")
    best_of = body.get("best_of")
    if best_of is not None and best_of != c.n:
        raise bad_request("best_of other than n is not supported", "best_of", "unsupported")
    skip_special = opt_bool(body, "skip_special_tokens", True)
    explicit = body.get("max_tokens") is not None
    plans = [(ids, st.fit_max_tokens(c, len(ids), explicit, "prompt")) for ids in prompts]
    echo_logprobs = echo and c.params.logprobs
    reports = None
    if echo or prompt_k is not None:
        scored = echo_logprobs or prompt_k is not None
        reports = [PromptReport(tokenizer, st.token_str, ids, skip_special,
                                st.scorer.score(ids) if scored else None) for ids, _ in plans]
    echo_texts = [r.text for r in reports] if echo else ["" for _ in plans]
    guide_factory = None
    if grammar is not None:
        guide_factory = StructuredGuideBuilder(grammar, tokenizer, engine.vocab_size, fmt=None).build
    return CompletionPlan(plans, c, echo_texts, skip_special, reports, echo_logprobs, prompt_k, generate,
                          guide_factory)


def prompt_fields(plan: CompletionPlan, k: int) -> tuple[Optional[dict], dict]:
    """(the prompt's legacy logprobs or None, extra choice fields) for prompt ``k``."""
    if plan.reports is None:
        return None, {}
    rep = plan.reports[k]
    lp = rep.legacy_logprobs(plan.c.params.top_logprobs) if plan.echo_logprobs else None
    more = {"prompt_logprobs": rep.prompt_logprobs(plan.prompt_k)} if plan.prompt_k is not None else {}
    return lp, more


def prompt_only_choices(plan: CompletionPlan) -> list[dict]:
    """The choices of a max_tokens 0 answer: each prompt's report, ``n`` times."""
    n, choices = plan.c.n, []
    for k in range(len(plan.prompts)):
        lp, more = prompt_fields(plan, k)
        for i in range(n):
            choices.append({"index": k * n + i, "text": plan.echo_texts[k], "logprobs": lp,
                            "finish_reason": "length", "stop_reason": None, **more})
    return choices


def prompt_only_response(st: ServerState, plan: CompletionPlan, rid: str, created: int) -> dict:
    """A max_tokens 0 answer, whole."""
    n_prompt = sum(len(ids) for ids, _ in plan.prompts)
    return {"id": rid, "object": "text_completion", "created": created, "model": st.model_name,
            "choices": prompt_only_choices(plan), "usage": usage(n_prompt, 0, 0)}


async def prompt_only_stream(st: ServerState, plan: CompletionPlan, rid: str, created: int):
    """A max_tokens 0 answer as events: a chunk per choice, the usage chunk when asked, ``[DONE]``."""
    base = {"id": rid, "object": "text_completion", "created": created, "model": st.model_name}
    extra = {"usage": None} if plan.c.include_usage else {}
    for ch in prompt_only_choices(plan):
        yield sse({**base, "choices": [ch], **extra})
    if plan.c.include_usage:
        yield sse({**base, "choices": [], "usage": usage(sum(len(ids) for ids, _ in plan.prompts), 0, 0)})
    yield "data: [DONE]\n\n"


def parse_prompts(st: ServerState, prompt) -> list[list[int]]:
    """``prompt`` -> token ids per prompt (strings encoded, ids range-checked); a 400 for any other shape."""
    if isinstance(prompt, str):
        return [st.tokenizer.encode(prompt)]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [st.tokenizer.encode(p) for p in prompt]
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            return [check_ids(prompt, st.engine.vocab_size)]
        if all(isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
               for p in prompt):
            return [check_ids(p, st.engine.vocab_size) for p in prompt]
    raise bad_request("'prompt' must be a string, a list of strings, a list of token ids or a list of such lists "
                      "(non-empty)", "prompt", "invalid_type")


def check_ids(ids, vocab_size: int) -> list[int]:
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise bad_request(f"prompt token ids must lie in [0, {vocab_size})", "prompt")
    return list(ids)


def piece_text(tokenizer, pieces, skip_special: bool) -> str:
    """An event's text: its text pieces, and its control tokens' names unless ``skip_special``."""
    if skip_special:
        return "".join(p for p in pieces if isinstance(p, str))
    return "".join(p if isinstance(p, str) else (tokenizer.special_name(p) or "") for p in pieces)


def legacy_logprobs(st: ServerState, lps, offset0: int, texts: list[str]) -> dict:
    """OpenAI's legacy ``logprobs`` of generated tokens whose texts are ``texts``, starting at ``offset0``."""
    offsets, pos = [], offset0
    for t in texts:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": [st.token_str(x.token_id) for x in lps], "token_logprobs": [x.logprob for x in lps],
            "top_logprobs": [{st.token_str(t): lp for t, lp in x.top} for x in lps], "text_offset": offsets}


async def merged(streams):
    """The events of several ``RequestStream``s as ``(stream index, event)`` in arrival order, until every stream
    sent its ``RequestDone``; a stream's exception is raised here."""
    q: asyncio.Queue = asyncio.Queue()

    async def pump(k, s):
        try:
            async for ev in s:
                await q.put((k, ev))
        except BaseException as e:  # noqa: BLE001 -- handed to the consumer
            await q.put((k, e))

    tasks = [asyncio.create_task(pump(k, s)) for k, s in enumerate(streams)]
    left = len(streams)
    try:
        while left:
            k, ev = await q.get()
            if isinstance(ev, BaseException):
                raise ev
            if isinstance(ev, RequestDone):
                left -= 1
            yield k, ev
    finally:
        for t in tasks:
            t.cancel()


async def completion_stream(st: ServerState, streams, rids, rid, created, c, plan: CompletionPlan):
    """The streamed answer's events: the echoed prompts first, then each choice's text as it comes and its finish
    chunk, the usage chunk when asked, ``[DONE]`` (or an error chunk).  Aborts what is left if the client leaves."""
    echo_texts, skip_special = plan.echo_texts, plan.skip_special
    n = c.n
    dones: dict[int, RequestDone] = {}
    base = {"id": rid, "object": "text_completion", "created": created, "model": st.model_name}
    extra = {"usage": None} if c.include_usage else {}
    text_len: dict[int, int] = {}
    try:
        if plan.reports is not None:
            for k, t in enumerate(echo_texts):
                lp, more = prompt_fields(plan, k)
                for i in range(n):
                    text_len[k * n + i] = len(t)
                    yield sse({**base, "choices": [{"index": k * n + i, "text": t, "logprobs": lp,
                                                    "finish_reason": None, **more}], **extra})
        async for k, ev in merged(streams):
            if isinstance(ev, RequestDone):
                dones[k] = ev
                continue
            idx = k * n + ev.index
            text = piece_text(st.tokenizer, ev.pieces, skip_special)
            lp = None
            if ev.logprobs:
                lp = legacy_logprobs(st, ev.logprobs, text_len.get(idx, 0), [text] + [""] * (len(ev.logprobs) - 1))
            text_len[idx] = text_len.get(idx, 0) + len(text)
            if text or lp or ev.finish_reason is None:
                yield sse({**base, "choices": [{"index": idx, "text": text, "logprobs": lp,
                                                "finish_reason": None}], **extra})
            if ev.finish_reason is not None:
                yield sse({**base, "choices": [{"index": idx, "text": "", "logprobs": None,
                                                "finish_reason": ev.finish_reason,
                                                "stop_reason": ev.stop_reason}], **extra})
        if c.include_usage:
            yield sse({**base, "choices": [], "usage": total_usage(dones.values())})
        yield "data: [DONE]\n\n"
    except EngineError as e:
        yield sse_error(e)
    finally:
        st.drain.untrack(rid)
        if len(dones) < len(rids) and st.engine.alive:
            log.info("%s: client disconnected mid-stream; request aborted", rid)
        for k, r in enumerate(rids):
            if k not in dones:
                st.engine.abort(r)


async def completion_full(st: ServerState, request: Request, streams, rids, rid, created, c,
                          plan: CompletionPlan) -> dict:
    """The whole answer once every prompt's choices finished (a 503 ``APIError`` if the engine cannot finish
    them); every prompt's request is aborted if the client leaves first."""
    echo_texts, skip_special = plan.echo_texts, plan.skip_special
    n = c.n
    outs = {k * n + i: SequenceOutput(i) for k in range(len(streams)) for i in range(n)}
    texts: dict[int, list[str]] = {idx: [] for idx in outs}  # text of each generated token
    extra_text: dict[int, str] = {idx: "" for idx in outs}  # text flushed by a final event without a token
    dones: dict[int, RequestDone] = {}
    watcher = asyncio.create_task(st.watch_disconnect(request, rids, rid))
    try:
        async for k, ev in merged(streams):
            if isinstance(ev, RequestDone):
                dones[k] = ev
                continue
            idx = k * n + ev.index
            apply_event(outs[idx], ev)
            if ev.token_ids:
                texts[idx].append(piece_text(st.tokenizer, ev.pieces, skip_special))
            else:
                extra_text[idx] += piece_text(st.tokenizer, ev.pieces, skip_special)
    except EngineError as e:
        raise engine_api_error(e) from None
    finally:
        st.drain.untrack(rid)
        watcher.cancel()
        for k, r in enumerate(rids):
            if k not in dones:
                st.engine.abort(r)
    choices = []
    for idx in sorted(outs):
        k = idx // n
        o = outs[idx]
        lp = None
        if c.params.logprobs:
            lp = legacy_logprobs(st, o.logprobs, len(echo_texts[k]), texts[idx])
        prompt_lp, more = prompt_fields(plan, k)
        choices.append({"index": idx, "text": echo_texts[k] + "".join(texts[idx]) + extra_text[idx],
                        "logprobs": merge_logprobs(prompt_lp, lp),
                        "finish_reason": o.finish_reason, "stop_reason": o.stop_reason, **more})
    return {"id": rid, "object": "text_completion", "created": created, "model": st.model_name,
            "choices": choices,
            "usage": total_usage(dones.values())}


def total_usage(dones) -> dict:
    """``usage`` summed over the prompts' ``RequestDone``s."""
    dones = list(dones)
    return usage(sum(d.num_prompt_tokens for d in dones), sum(d.num_generated_total for d in dones),
                 sum(d.num_cached_tokens for d in dones))
