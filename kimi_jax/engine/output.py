"""Output for ``Engine``: each sampled token through its sequence's guide, stop checks (engine.py's module
docstring, item 4) and detokenizer into a ``SeqEvent`` on the request's stream (``_emit``); a sequence's end, which
frees its slot and pages wherever it is -- running, waiting for its recompute, or in it (``_end_seq``); a request's
end, ``RequestDone`` to its stream and to the listeners (``_finish_request``).

``OutputMixin`` is a base of ``Engine`` and runs on the engine thread only.
Reads: ``tokenizer``, ``stop_ids``, ``max_model_len``, ``proposer``, ``spec_policy``, ``listeners``, ``_prefilling``.
Writes: ``_running``, ``_free``, ``_waiting``, ``_requests``, ``alloc``; the counters ``generation_tokens_total``,
``requests_finished``.  Stops a running recompute through ``SchedulerMixin._cancel_prefill``; leaves a finished
sequence's checkpoint and pages to the prefix cache through ``SchedulerMixin._checkpoint_sequence``.
"""

from __future__ import annotations

import logging
import time

from .request import RequestDone, SeqEvent, TokenLogprob
from .sequences import _Request, _Seq

log = logging.getLogger("kimi_jax.engine")


class OutputMixin:
    """Emission, stops and finishing: a base of ``Engine`` (its attributes: above)."""

    def _emit(self, seq: _Seq, tok: int, lp: float, top_ids, top_lps, now: float) -> None:
        req, p = seq.req, seq.req.params
        seq.output_ids.append(tok)
        self.generation_tokens_total += 1
        if req.first_token_time is None:
            req.first_token_time = now
        guide_failed = False
        if seq.guide is not None:
            try:
                seq.guide.advance(tok)
            except Exception:  # noqa: BLE001 -- one request's guide must not take the engine down
                log.exception("guide of request %s failed; aborting that sequence", req.request_id)
                guide_failed = True
        logprobs = None
        if p.logprobs:
            k = min(p.top_logprobs, len(top_ids))
            logprobs = [TokenLogprob(tok, lp, [(int(top_ids[j]), float(top_lps[j])) for j in range(k)])]
        finish, stop_reason, pieces = None, None, []
        is_stop_tok = tok in p.stop_token_ids or (tok in self.stop_ids and not p.ignore_eos)
        if is_stop_tok:
            pieces = seq.text.finish()
            if self.tokenizer.is_special(tok):
                pieces.append(tok)
            finish = "stop"
            stop_reason = None if tok in self.stop_ids else tok
        else:
            pieces, hit = seq.text.push(tok)
            if hit is not None:
                finish, stop_reason = "stop", hit
            elif guide_failed:
                finish = "abort"
            elif seq.guide is not None and seq.guide.finished:
                finish = "stop"
            elif len(seq.output_ids) >= p.max_tokens or len(req.prompt_ids) + len(seq.output_ids) >= self.max_model_len:
                finish = "length"
            if finish is not None and hit is None:
                pieces += seq.text.finish()
        if finish is None:
            seq.pending.append(tok)
            req.stream.put(SeqEvent(seq.index, [tok], pieces, logprobs))
        else:
            self._end_seq(seq, finish, stop_reason, pieces, [tok], logprobs)

    def _end_seq(self, seq: _Seq, reason: str, stop_reason, pieces, token_ids=(), logprobs=None) -> None:
        seq.finish_reason = reason
        proposer = self.proposer
        if proposer is not None:
            proposer.forget(seq.key)
        self.spec_policy.forget(seq.key)
        req = seq.req
        req.stream.put(SeqEvent(seq.index, list(token_ids), pieces, logprobs, reason, stop_reason))
        if seq.slot is not None and self._running.get(seq.slot) is seq:
            self._checkpoint_sequence(seq)  # its prompt and answer stay cached for a next turn
            del self._running[seq.slot]
            self._free.append(seq.slot)
        elif seq in self._waiting:  # preempted, waiting for its recompute
            self._waiting.remove(seq)
        elif self._prefilling is not None and self._prefilling.seq is seq:  # its recompute is running
            self._cancel_prefill()
        self.alloc.free(seq.key, missing_ok=True)
        if all(s.finish_reason is not None for s in req.seqs):
            self._finish_request(req)

    def _finish_request(self, req: _Request) -> None:
        if req.done:
            return
        req.done = True
        self._requests.pop(req.request_id, None)
        self.requests_finished += 1
        reasons = [s.finish_reason or "abort" for s in req.seqs] or ["abort"] * req.n
        done = RequestDone(req.request_id, len(req.prompt_ids), req.cached_tokens,
                           [len(s.output_ids) for s in req.seqs] or [0] * req.n, reasons, req.arrival,
                           req.first_token_time, time.monotonic())
        for lst in self.listeners:
            try:
                lst.on_request_done(done)
            except Exception:  # noqa: BLE001 -- metrics must not kill the engine
                log.exception("request listener failed")
        req.stream.put(done)
