"""Prompt-lookup drafting for speculative decoding: propose what followed the latest earlier occurrence of the
sequence's last n tokens (n from ``max_n`` down to ``min_n``); where that runs into the end of the context, the
repetition continues periodically (the latest match of a run "x x x" is one token back: it drafts "x x x ...").

No second model: it pays where the output repeats its context (code edits, quoting, summaries, structured output),
and costs only a wider verify step elsewhere.  Each sequence keeps an index per n-gram size, n-gram -> the position
right after its latest occurrence whose next token is known, grown by one entry per size for every new token, so a
proposal costs O(max_n − min_n) dictionary lookups however long the context is (the prompt is indexed once, on the
sequence's first proposal).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence


@dataclass
class _Index:
    by_n: dict = field(default_factory=dict)  # n -> {n-gram tuple: position after its latest indexed occurrence}
    indexed: int = 0  # tokens seen; n-grams ending before position indexed - 1 are in the index
    last: int = -1  # the token at position indexed - 1 (a cheap check that the context is still the same one)


class NgramProposer:
    """Drafts up to ``k`` tokens per sequence by n-gram lookup in that sequence's own tokens."""

    def __init__(self, k: int, min_n: int = 2, max_n: int = 4):
        if k < 1:
            raise ValueError(f"speculative tokens must be >= 1, got {k}")
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.k, self.min_n, self.max_n = int(k), int(min_n), int(max_n)
        self._seqs: dict = {}

    def propose(self, seq_id, tokens: Sequence[int], max_tokens: int) -> list[int]:
        """Up to ``min(k, max_tokens)`` drafts following ``tokens`` (the sequence's whole context, which only grows
        between calls for one ``seq_id``; a shorter or different context starts its index again)."""
        limit = min(self.k, int(max_tokens))
        if limit < 1:
            return []
        idx = self._update(seq_id, tokens)
        L = len(tokens)
        suffix = [int(t) for t in tokens[max(L - self.max_n, 0):]]
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            start = idx.by_n.get(n, {}).get(tuple(suffix[len(suffix) - n:]))
            if start is not None:
                # past the end of the context the match predicts its own continuation again: the text from
                # `start` on repeats with period L - start (a run of one token drafts k of them, not one)
                period = L - start
                return [int(tokens[start + i % period]) for i in range(limit)]
        return []

    def forget(self, seq_id) -> None:
        """Drop a finished (or preempted) sequence's index."""
        self._seqs.pop(seq_id, None)

    def _update(self, seq_id, tokens: Sequence[int]) -> _Index:
        idx = self._seqs.get(seq_id)
        L = len(tokens)
        if idx is None or L < idx.indexed or (idx.indexed and int(tokens[idx.indexed - 1]) != idx.last):
            idx = self._seqs[seq_id] = _Index()  # new, or not the same sequence any more: index it again
        lo = max(idx.indexed - self.max_n, 0)
        seg = [int(t) for t in tokens[lo:L]]  # the new tokens and the max_n before them; seg[i] = tokens[lo + i]
        # the n-gram ending at position j - 1 (tokens[j-n:j]) is followed by tokens[j]: index it for every j < L
        for j in range(max(idx.indexed, 1), L):
            for n in range(self.min_n, min(self.max_n, j) + 1):
                idx.by_n.setdefault(n, {})[tuple(seg[j - n - lo:j - lo])] = j
        idx.indexed = L
        idx.last = seg[-1] if seg else -1
        return idx
