"""Incremental output text of one sequence, with stop strings.

``OutputText.push(token_id)`` returns the new output *pieces* -- text (``str``) and control tokens (``int`` ids, kept as
ids so that the chat parsers see structure, never text that merely spells a control token) -- and the stop string
that ended the output, if one did.

* UTF-8 characters split over tokens are held until complete (``Tokenizer.stream_decoder``).
* Text that could still turn out to be the start of a stop string is held back (only the longest suffix that is a
  proper prefix of some stop string, so ordinary text streams without delay).  When a stop string appears, the
  output ends right before it (or right after it with ``include_stop``); text after it is dropped.
* A control token ends any pending text first (stop strings never span a control token).
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

Piece = Union[str, int]


class OutputText:
    def __init__(self, tokenizer, stop: Sequence[str] = (), include_stop: bool = False):
        self._tok = tokenizer
        self._dec = tokenizer.stream_decoder()
        self._stop = tuple(s for s in stop if s)
        self._include = include_stop
        self._buf = ""  # decoded text not yet emitted
        self.stopped: Optional[str] = None

    def push(self, token_id: int) -> tuple[list[Piece], Optional[str]]:
        """Feed one generated id.  Returns (pieces, stop string that ended the output or None)."""
        if self.stopped is not None:
            return [], None
        token_id = int(token_id)
        if self._tok.is_special(token_id):
            pieces, hit = self._text(self._dec.flush(), final=True)
            if hit is None:
                pieces.append(token_id)
            return pieces, hit
        return self._text(self._dec.push_bytes(self._tok.token_bytes(token_id)), final=False)

    def finish(self) -> list[Piece]:
        """End of output: everything still held (an unfinished character becomes U+FFFD)."""
        if self.stopped is not None:
            return []
        pieces, _ = self._text(self._dec.flush(), final=True)
        return pieces

    def _text(self, new: str, final: bool) -> tuple[list[Piece], Optional[str]]:
        if not self._stop:
            return ([new] if new else []), None
        buf = self._buf + new
        best = None
        for s in self._stop:
            i = buf.find(s)
            if i >= 0 and (best is None or i < best[0] or (i == best[0] and len(s) > len(best[1]))):
                best = (i, s)
        if best is not None:
            i, s = best
            out = buf[: i + len(s)] if self._include else buf[:i]
            self._buf = ""
            self.stopped = s
            return ([out] if out else []), s
        keep = 0 if final else _held_suffix(buf, self._stop)
        emit = buf[: len(buf) - keep]
        self._buf = buf[len(buf) - keep:]
        return ([emit] if emit else []), None


def _held_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``stops``."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


def pieces_text(pieces: Sequence[Piece], tokenizer=None) -> str:
    """Text of pieces; control tokens are dropped, or spelled by name when a tokenizer is given."""
    out = []
    for p in pieces:
        if isinstance(p, str):
            out.append(p)
        elif tokenizer is not None:
            out.append(tokenizer.special_name(p) or "")
    return "".join(out)
