"""Guided decoding: per-sequence token constraints, evaluated on the host once per step.

A ``Guide`` says, before each step, which tokens its sequence may produce next (``constraint()``; ``None`` means
anything), and is told the token that was produced (``advance``).  The engine turns the constraints of all rows into
two fixed-shape arrays (a vocabulary-class index per row and up to ``MAX_ALLOWED_IDS`` extra ids per row), and the
jitted sampler masks everything else to -inf -- so guided rows share the one compiled decode step with free rows, and
a constraint that allows a single token forces it ("jump-forward"; the forced token's logprob is still the model's).

Building blocks (``ProgramGuide`` runs them in order):

* ``Forced(ids)``               exactly these tokens;
* ``Choice([(ids, then), ...])`` one of several token sequences (a trie; none may be a prefix of another), followed
                                 by the parts of the chosen branch;
* ``Text(vocab_class, end_ids, max_tokens)``  tokens of a vocabulary class until one of ``end_ids`` (which is
                                 produced) -- forced after ``max_tokens``;
* ``FreeUntil(end_ids)``        anything until one of ``end_ids`` is produced.

A constraint may instead carry an arbitrary allowed set as a packed bitmask (``Constraint.bits``: int32 words, bit
``t % 32`` of word ``t // 32`` for token t -- the layout grammar engines such as llguidance fill): the engine writes it
into a per-slot row of the class table for that step (``Engine``'s dynamic rows), so a grammar-guided row also shares
the one compiled step.  ``GrammarPart`` parts (``kimi_jax.serve.structured``) produce these.

Vocabulary classes (``vocab_class_masks``): ``ALL``, ``ONLY_IDS`` (nothing but the listed ids), ``TEXT`` (ordinary BPE
tokens, no control tokens), ``DIGITS`` (tokens made of ASCII digits only), ``NUMBER_START`` (digit tokens not
starting with "0", so a number built from it is valid JSON).

The server uses these for ``tool_choice="required"`` / a named tool (``kimi_jax.serve.tool_guide``); tests use
``TokenSequenceGuide`` to drive the parsers with exact token sequences through the real engine.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

import numpy as np

ALL, ONLY_IDS, TEXT, DIGITS, NUMBER_START = range(5)
NUM_VOCAB_CLASSES = 5
MAX_ALLOWED_IDS = 64


@dataclass(frozen=True)
class Constraint:
    """Allowed next tokens: every token of ``vocab_class`` plus ``ids`` -- or, when ``bits`` is set, exactly the
    tokens whose bit is set there (int32 words ``[ceil(V / 32)]``; ``vocab_class`` and ``ids`` are then ignored)."""

    vocab_class: int = ALL
    ids: tuple[int, ...] = ()
    bits: Optional[np.ndarray] = field(default=None, compare=False)

    def allows(self, token_id: int, class_masks: np.ndarray) -> bool:
        if self.bits is not None:
            return bit_set(self.bits, token_id)
        return bool(class_masks[self.vocab_class, token_id]) or token_id in self.ids


def bit_set(bits: np.ndarray, token_id: int) -> bool:
    w = int(token_id) >> 5
    return w < len(bits) and bool((int(bits[w]) >> (int(token_id) & 31)) & 1)


def unpack_bits(bits: np.ndarray, vocab_size: int) -> np.ndarray:
    """Packed int32 words -> bool ``[..., vocab_size]`` (numpy; bit t % 32 of word t // 32)."""
    b = np.ascontiguousarray(bits, dtype=np.int32).view(np.uint8)
    return np.unpackbits(b, axis=-1, bitorder="little")[..., :vocab_size].astype(bool)


def class_table_rows(max_num_seqs: int, speculative_tokens: int) -> int:
    """Rows of the sampler's class table an engine passes its runner: the vocabulary classes, then one dynamic row
    per slot and verify position (a step's grammar bitmask for that row, `Constraint.bits`)."""
    return NUM_VOCAB_CLASSES + max_num_seqs * (max(0, speculative_tokens) + 1)


def vocab_class_masks(tokenizer, vocab_size: int) -> np.ndarray:
    """``[NUM_VOCAB_CLASSES, vocab_size]`` bool table, one row per class (see the module docstring)."""
    masks = np.zeros((NUM_VOCAB_CLASSES, vocab_size), bool)
    masks[ALL] = True
    digits = set(b"0123456789")
    for tid in range(min(vocab_size, tokenizer.vocab_size)):
        if tokenizer.is_special(tid):
            continue
        b = tokenizer.token_bytes(tid)
        if not b:
            continue
        masks[TEXT, tid] = True
        if all(c in digits for c in b):
            masks[DIGITS, tid] = True
            masks[NUMBER_START, tid] = b[0] != ord("0")
    return masks


class Guide:
    """Interface.  ``constraint()`` -> ``Constraint`` or ``None`` (free); ``advance(token)``; ``finished``."""

    def constraint(self) -> Optional[Constraint]:
        return None

    def advance(self, token_id: int) -> None:
        pass

    @property
    def finished(self) -> bool:
        return False


# ----------------------------------------------------------------------------------------------------------- parts
class _Part:
    def constraint(self) -> Optional[Constraint]:
        raise NotImplementedError

    def advance(self, token_id: int) -> tuple[bool, list["_Part"]]:
        """Consume a token; returns (this part is done, parts to run next before the remaining ones)."""
        raise NotImplementedError

    def most_tokens(self) -> int:
        """The most tokens this part (with what it leads to) can produce, from its start."""
        raise TypeError(f"no length bound for {type(self).__name__}")


def most_tokens(parts: Sequence[_Part]) -> int:
    """The most tokens a sequence of parts can produce (e.g. what a budget must leave for a guided call)."""
    return sum(p.most_tokens() for p in parts)


class Forced(_Part):
    def __init__(self, ids: Sequence[int]):
        self.ids = [int(i) for i in ids]
        self.pos = 0

    def constraint(self):
        return Constraint(ONLY_IDS, (self.ids[self.pos],)) if self.pos < len(self.ids) else None

    def advance(self, token_id):
        self.pos += 1
        return self.pos >= len(self.ids), []

    def most_tokens(self):
        return len(self.ids)


class Choice(_Part):
    """One of several token sequences; ``options`` is a list of (ids, continuation parts)."""

    def __init__(self, options: Sequence[tuple[Sequence[int], Sequence[_Part]]]):
        opts = []
        seen = set()
        for ids, then in options:
            key = tuple(int(i) for i in ids)
            if not key:
                raise ValueError("a choice option must have at least one token")
            if key in seen:
                continue
            seen.add(key)
            opts.append((key, list(then)))
        for a, _ in opts:
            for b, _ in opts:
                if a != b and b[: len(a)] == a:
                    raise ValueError(f"choice option {a} is a prefix of {b}; options must be prefix-free")
        next_ids: dict[tuple, set] = {}  # the trie's branching: the tokens that may follow each prefix
        for key, _ in opts:
            for n in range(len(key)):
                next_ids.setdefault(key[:n], set()).add(key[n])
        widest = max(len(v) for v in next_ids.values()) if next_ids else 0
        if widest > MAX_ALLOWED_IDS:
            raise ValueError(f"a choice branches {widest} ways at one token; at most {MAX_ALLOWED_IDS}")
        self.options = opts
        self.prefix: list[int] = []

    def _live(self):
        n = len(self.prefix)
        return [(ids, then) for ids, then in self.options if list(ids[:n]) == self.prefix]

    def constraint(self):
        n = len(self.prefix)
        nxt = sorted({ids[n] for ids, _ in self._live()})  # at most MAX_ALLOWED_IDS: checked when built
        return Constraint(ONLY_IDS, tuple(nxt))

    def advance(self, token_id):
        self.prefix.append(int(token_id))
        live = self._live()
        for ids, then in live:
            if len(ids) == len(self.prefix):
                return True, then
        if not live:  # cannot happen when the constraint was applied; end the choice rather than loop
            return True, []
        return False, []

    def most_tokens(self):
        return max(len(ids) + most_tokens(then) for ids, then in self.options)


class Text(_Part):
    """Tokens of ``vocab_class`` until one of ``end_ids`` (at least ``min_tokens`` first, at most ``max_tokens``);
    the first token may come from another class (``first_class``, e.g. a number's leading digits)."""

    def __init__(self, vocab_class: int, end_ids: Sequence[int], max_tokens: int, min_tokens: int = 0,
                 first_class: Optional[int] = None):
        if not end_ids:
            raise ValueError("Text needs at least one end id")
        if max_tokens < max(min_tokens, 0):
            raise ValueError(f"Text: max_tokens {max_tokens} < min_tokens {min_tokens}")
        self.vocab_class = vocab_class
        self.first_class = vocab_class if first_class is None else first_class
        self.end_ids = tuple(int(i) for i in end_ids)
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens
        self.count = 0

    def constraint(self):
        if self.count >= self.max_tokens:
            return Constraint(ONLY_IDS, self.end_ids[:1])
        cls = self.first_class if self.count == 0 else self.vocab_class
        if self.count < self.min_tokens:
            return Constraint(cls, ())
        return Constraint(cls, self.end_ids)

    def advance(self, token_id):
        if int(token_id) in self.end_ids:
            return True, []
        self.count += 1
        return False, []

    def most_tokens(self):
        return self.max_tokens + 1  # the end id included


class FreeUntil(_Part):
    def __init__(self, end_ids: Iterable[int]):
        self.end_ids = frozenset(int(i) for i in end_ids)

    def constraint(self):
        return None

    def advance(self, token_id):
        return int(token_id) in self.end_ids, []


class ProgramGuide(Guide):
    """Runs parts in order; finished when all are done."""

    def __init__(self, parts: Sequence[_Part]):
        self._parts = deque(parts)

    def constraint(self):
        return self._parts[0].constraint() if self._parts else None

    def advance(self, token_id):
        if not self._parts:
            return
        done, then = self._parts[0].advance(token_id)
        if done:
            self._parts.popleft()
            self._parts.extendleft(reversed(then))

    @property
    def finished(self) -> bool:
        return not self._parts


def TokenSequenceGuide(ids: Sequence[int]) -> ProgramGuide:
    """Forces exactly ``ids``; the sequence finishes (reason "stop") right after the last one."""
    return ProgramGuide([Forced(ids)])
