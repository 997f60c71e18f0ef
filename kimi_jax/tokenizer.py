"""Kimi tokenizer: tiktoken byte-level BPE plus the Kimi control tokens.

Kimi checkpoints ship their vocabulary as ``tiktoken.model``: one line per token, ``<base64 bytes> <rank>``; the
ranks are the ordinary token ids ``0 .. n-1`` (163,584 of them for Kimi K2 / Kimi-Linear / K3).  The 256 ids after
them are reserved for control ("special") tokens; ``tokenizer_config.json``'s ``added_tokens_decoder`` names them.

Rules kept here (docs/model.md §11):

* ``encode(text)`` never yields a control-token id: text that spells ``<|open|>`` is tokenised as ordinary bytes.
  Control tokens only enter a prompt as ids, placed by the chat encoder (``kimi_jax.serve.chat``).
* ``decode(ids)`` turns control ids into their names (``"<|open|>"``) unless asked to skip them; ids that are neither
  a rank nor a control token decode to nothing (model output must never crash the server).
* ``StreamDecoder`` emits text only once a UTF-8 character is complete, so a character split over two tokens never
  shows up as a replacement character mid-stream.

Pre-tokenisation (``KIMI_PAT_STR``): the ``tiktoken.model`` file does not carry the split regex, so we supply one in
the style of cl100k/o200k with one Kimi-specific change -- runs of Han ideographs form their own pieces:

  1. ``\\p{Han}+``                      -- a run of CJK ideographs;
  2. words: an optional leading non-letter/non-digit (usually a space) + letters in ``Camel``/``lower``/``UPPER`` shape
     (Han excluded), with an optional English contraction suffix (``'s 't 're 've 'm 'll 'd``, any case);
  3. ``\\p{N}{1,3}``                    -- digits in groups of at most three;
  4. `` ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*``     -- a punctuation/symbol run, optionally after one space;
  5. newline runs (with leading blanks), trailing whitespace, other whitespace.

Every piece is later BPE-merged with the checkpoint's ranks, so any split regex yields a valid, losslessly decodable
encoding; a regex differing from the one used in training only changes which (valid) token split some rare inputs
get.  Pass ``pat_str=`` to use another regex.

Long inputs (``encode``): as in the Kimi / Llama 3 tiktoken tokenizers, text is encoded in windows of at most
400,000 characters, and a run of more than 25,000 consecutive whitespace (or non-whitespace) characters is cut
every 25,000 characters.  Without the cuts, tiktoken's regex engine gives up on a run of ~1M spaces ("Max stack
size exceeded for backtracking"); the cuts only change how such runs are split into tokens.
"""

from __future__ import annotations

import base64
import codecs
import json
import os
import re
from pathlib import Path
from typing import Iterable, Mapping

import tiktoken

__all__ = [
    "KIMI_PAT_STR",
    "K3_SPECIAL_OFFSETS",
    "K2_SPECIAL_OFFSETS",
    "NUM_RESERVED_SPECIAL",
    "TINY_TIKTOKEN_PATH",
    "TINY_NUM_RANKS",
    "TINY_NUM_RESERVED",
    "StreamDecoder",
    "Tokenizer",
    "load_tiktoken_ranks",
    "save_tiktoken_ranks",
    "special_token_map",
]

# --------------------------------------------------------------------------------------------------------------------
# Pre-tokenisation regex (see the module docstring).  Written with fancy-regex syntax (what tiktoken uses); the `&&`
# class intersection also works in the `regex` package with the V1 flag.
_NOT_HAN_UPPERISH = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_NOT_HAN_LOWERISH = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_LEAD = r"[^\r\n\p{L}\p{N}]?"

KIMI_PAT_STR = "|".join(
    [
        r"\p{Han}+",
        _LEAD + _NOT_HAN_UPPERISH + "*" + _NOT_HAN_LOWERISH + "+" + _CONTRACTION,
        _LEAD + _NOT_HAN_UPPERISH + "+" + _NOT_HAN_LOWERISH + "*" + _CONTRACTION,
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)

# --------------------------------------------------------------------------------------------------------------------
# Control tokens.  Offsets are relative to the first id after the BPE ranks (163584 in the real checkpoints).
NUM_RESERVED_SPECIAL = 256

K3_SPECIAL_OFFSETS: dict[str, int] = {
    "[BOS]": 0,
    "[EOS]": 1,
    "<|end_of_msg|>": 2,
    "<|open|>": 3,
    "<|close|>": 4,
    "<|sep|>": 5,
    "<|media_begin|>": 18,
    "<|media_content|>": 19,
    "<|media_end|>": 20,
    "<|media_pad|>": 21,
    "[PAD]": 255,
}

# Kimi K2 / Kimi-Linear (the older <|im_*|> chat template).  <think> / </think> are ordinary text there; the
# K2-Thinking checkpoints later added them as control tokens at offsets 22 / 23 (``think_tokens=True``).
K2_SPECIAL_OFFSETS: dict[str, int] = {
    "[BOS]": 0,
    "[EOS]": 1,
    "<|im_end|>": 2,
    "<|im_user|>": 3,
    "<|im_assistant|>": 4,
    "<|start_header_id|>": 6,
    "<|end_header_id|>": 7,
    "[EOT]": 9,
    "<|im_system|>": 10,
    "<|tool_calls_section_begin|>": 11,
    "<|tool_calls_section_end|>": 12,
    "<|tool_call_begin|>": 13,
    "<|tool_call_argument_begin|>": 14,
    "<|tool_call_end|>": 15,
    "<|im_middle|>": 17,
    "<|media_begin|>": 18,
    "<|media_content|>": 19,
    "<|media_end|>": 20,
    "<|media_pad|>": 21,
    "[UNK]": 254,
    "[PAD]": 255,
}
_K2_THINK_OFFSETS = {"<think>": 22, "</think>": 23}

# DeepSeek-V3.2's chat markers, for tokenizers packed here (the tiny "dsv32" family: tests of its chat format); the
# real DeepSeek vocabulary is no tiktoken file and places them elsewhere
DSV32_SPECIAL_OFFSETS: dict[str, int] = {
    "<｜begin▁of▁sentence｜>": 0,
    "<｜end▁of▁sentence｜>": 1,
    "<｜User｜>": 2,
    "<｜Assistant｜>": 3,
    "<think>": 4,
    "</think>": 5,
    "[PAD]": 255,
}

# Tokens that sit at the top of the reserved block (counted from its end) in the compact layout.
_TOP_ANCHORED = {"[PAD]": 1, "[UNK]": 2}

_FAMILY_ALIASES = {
    "k3": "k3",
    "kimi_k3": "k3",
    "kimi_k31": "k3",
    "kimi-k3": "k3",
    "kimi-k3.1-pro": "k3",
    "k2": "k2",
    "kimi_k2": "k2",
    "kimi_linear": "k2",
    "kimi-linear": "k2",
    "kimi-linear-48b": "k2",
    "dsv32": "dsv32",
    "deepseek_v32": "dsv32",
}


def _reserved_name(token_id: int) -> str:
    return f"<|reserved_token_{token_id}|>"


def special_token_map(
    family: str,
    base_vocab_size: int,
    num_reserved: int = NUM_RESERVED_SPECIAL,
    *,
    think_tokens: bool = False,
    fill_reserved: bool = True,
) -> dict[str, int]:
    """Control-token map ``{name: id}`` for ``family`` ("k3" or "k2"; aliases such as "kimi_linear" accepted).

    ``base_vocab_size`` is the number of BPE ranks (the first control id).  With the real block size
    (``num_reserved == 256``) the ids are the checkpoint ones (K3: ``[BOS]`` 163584 ... ``[PAD]`` 163839 when
    ``base_vocab_size == 163584``).  A smaller block (e.g. the 24 ids of the ``tiny`` preset) uses a compact layout:
    the named tokens keep their relative order and are packed from ``base_vocab_size`` upwards, while ``[PAD]`` (and
    ``[UNK]``) stay at the top of the block.  Unnamed ids of the block get ``<|reserved_token_ID|>`` names when
    ``fill_reserved``, so every id below ``base_vocab_size + num_reserved`` decodes to something.
    ``think_tokens`` (k2 only) adds ``<think>``/``</think>`` as control tokens (K2-Thinking); by default they are text.
    """
    key = _FAMILY_ALIASES.get(family.lower())
    if key is None:
        raise ValueError(f"unknown tokenizer family {family!r}; expected one of {sorted(set(_FAMILY_ALIASES))}")
    if base_vocab_size <= 0 or num_reserved <= 0:
        raise ValueError(f"base_vocab_size and num_reserved must be positive, got {base_vocab_size}, {num_reserved}")
    offsets = dict({"k3": K3_SPECIAL_OFFSETS, "k2": K2_SPECIAL_OFFSETS, "dsv32": DSV32_SPECIAL_OFFSETS}[key])
    if key == "k2" and think_tokens:
        offsets.update(_K2_THINK_OFFSETS)
    if num_reserved >= NUM_RESERVED_SPECIAL:
        # real layout; an oversized block keeps [PAD]/[UNK] at the top of the block
        out = {}
        for name, off in offsets.items():
            if name in _TOP_ANCHORED:
                out[name] = base_vocab_size + num_reserved - _TOP_ANCHORED[name]
            else:
                out[name] = base_vocab_size + off
    else:
        packed = sorted((off, name) for name, off in offsets.items() if name not in _TOP_ANCHORED)
        anchored = [name for name in offsets if name in _TOP_ANCHORED]
        if len(packed) + len(anchored) > num_reserved:
            raise ValueError(
                f"{len(packed) + len(anchored)} {key} control tokens do not fit in a block of {num_reserved} ids"
            )
        out = {name: base_vocab_size + i for i, (_, name) in enumerate(packed)}
        for name in anchored:
            out[name] = base_vocab_size + num_reserved - _TOP_ANCHORED[name]
    if fill_reserved:
        used = set(out.values())
        for tid in range(base_vocab_size, base_vocab_size + num_reserved):
            if tid not in used:
                out[_reserved_name(tid)] = tid
    return dict(sorted(out.items(), key=lambda kv: kv[1]))


# --------------------------------------------------------------------------------------------------------------------
# tiktoken.model files


def load_tiktoken_ranks(path: str | os.PathLike) -> dict[bytes, int]:
    """Read a ``tiktoken.model`` file (``<base64 token> <rank>`` per line) into ``{token_bytes: rank}``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"tiktoken model file not found: {path}")
    ranks: dict[bytes, int] = {}
    seen_ranks: set[int] = set()
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            line = raw.strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ValueError(f"{path}:{lineno}: expected '<base64> <rank>', got {raw[:80]!r}")
            try:
                token = base64.b64decode(parts[0], validate=True)
                rank = int(parts[1])
            except ValueError as e:
                raise ValueError(f"{path}:{lineno}: bad token line {raw[:80]!r}: {e}") from None
            if token in ranks:
                raise ValueError(f"{path}:{lineno}: token {token!r} listed twice")
            if rank in seen_ranks:
                raise ValueError(f"{path}:{lineno}: rank {rank} listed twice")
            ranks[token] = rank
            seen_ranks.add(rank)
    if not ranks:
        raise ValueError(f"{path}: no tokens")
    return ranks


def save_tiktoken_ranks(ranks: Mapping[bytes, int], path: str | os.PathLike) -> None:
    """Write ``{token_bytes: rank}`` in the ``tiktoken.model`` format, sorted by rank."""
    ordered = sorted(ranks.items(), key=lambda kv: kv[1])
    lines = [f"{base64.b64encode(tok).decode('ascii')} {rank}\n" for tok, rank in ordered]
    Path(path).write_text("".join(lines), encoding="ascii")


# --------------------------------------------------------------------------------------------------------------------

_PACKAGE_DIR = Path(__file__).resolve().parent
TINY_TIKTOKEN_PATH = _PACKAGE_DIR / "data" / "tiny_tiktoken.model"
TINY_NUM_RANKS = 1000  # 256 byte tokens + 744 merges
TINY_NUM_RESERVED = 24  # ids 1000..1023: control tokens ([BOS] 1000 ... <|media_pad|> 1009, [PAD] 1023)

# Names of the end-of-turn tokens, by preference, for ``Tokenizer.eos_id``.
_EOS_PREFERENCE = ("<|end_of_msg|>", "<|im_end|>", "<｜end▁of▁sentence｜>", "[EOS]")
_STOP_NAMES = ("<|end_of_msg|>", "<|im_end|>", "<｜end▁of▁sentence｜>", "[EOS]", "[EOT]")


MAX_WINDOW_CHARS = 400_000  # characters encoded at once
MAX_RUN_CHARS = 25_000  # longest run of whitespace or of non-whitespace encoded as one piece
_LONG_RUN = re.compile(r"\s{%d,}|\S{%d,}" % (MAX_RUN_CHARS + 1, MAX_RUN_CHARS + 1))


def encode_pieces(text: str) -> list[str]:
    """``text`` cut into the pieces ``Tokenizer.encode`` encodes one by one: windows of ``MAX_WINDOW_CHARS``
    characters, and inside each, a run of more than ``MAX_RUN_CHARS`` whitespace (``str.isspace``) or
    non-whitespace characters cut every ``MAX_RUN_CHARS`` characters from the run's start."""
    pieces = []
    for w in range(0, len(text), MAX_WINDOW_CHARS):
        window = text[w:w + MAX_WINDOW_CHARS]
        start = 0
        for m in _LONG_RUN.finditer(window):
            for cut in range(m.start() + MAX_RUN_CHARS, m.end(), MAX_RUN_CHARS):
                pieces.append(window[start:cut])
                start = cut
        pieces.append(window[start:])
    return [p for p in pieces if p]


class Tokenizer:
    """tiktoken BPE over bytes + named control tokens.

    Build with ``Tokenizer.from_dir`` (a checkpoint directory), ``Tokenizer.from_file`` (a ``tiktoken.model``) or
    ``Tokenizer.tiny()`` (the built-in 1024-id vocabulary of the ``tiny`` preset).
    """

    def __init__(
        self,
        mergeable_ranks: Mapping[bytes, int],
        special_tokens: Mapping[str, int],
        pat_str: str = KIMI_PAT_STR,
        name: str = "kimi",
    ):
        ranks = dict(mergeable_ranks)
        specials = {str(k): int(v) for k, v in special_tokens.items()}
        rank_ids = set(ranks.values())
        clash = sorted(i for i in specials.values() if i in rank_ids)
        if clash:
            raise ValueError(f"control token ids collide with BPE ranks: {clash[:10]}")
        if len(set(specials.values())) != len(specials):
            raise ValueError("two control tokens share an id")
        missing_bytes = [b for b in range(256) if bytes([b]) not in ranks]
        if missing_bytes:
            raise ValueError(f"BPE vocabulary lacks single-byte tokens {missing_bytes[:10]}; text could not round-trip")
        self._ranks = ranks
        self._special = dict(sorted(specials.items(), key=lambda kv: kv[1]))
        self._special_by_id = {i: n for n, i in self._special.items()}
        self._special_bytes = {i: n.encode("utf-8") for n, i in self._special.items()}
        self.pat_str = pat_str
        self.name = name
        self._enc = tiktoken.Encoding(name, pat_str=pat_str, mergeable_ranks=ranks, special_tokens=self._special)
        self._num_ranks = len(ranks)
        self._vocab_size = max(max(rank_ids), max(self._special.values(), default=-1)) + 1

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_file(
        cls,
        tiktoken_model_path: str | os.PathLike,
        special_tokens: Mapping[str, int] | None = None,
        pat_str: str = KIMI_PAT_STR,
        *,
        family: str = "k3",
    ) -> "Tokenizer":
        """Load a ``tiktoken.model``.  ``special_tokens=None`` uses ``special_token_map(family, n_ranks)``."""
        ranks = load_tiktoken_ranks(tiktoken_model_path)
        if special_tokens is None:
            special_tokens = special_token_map(family, max(ranks.values()) + 1)
        return cls(ranks, special_tokens, pat_str=pat_str)

    @classmethod
    def from_dir(cls, path: str | os.PathLike, *, family: str = "k3", pat_str: str = KIMI_PAT_STR) -> "Tokenizer":
        """Load a checkpoint directory: ``tiktoken.model`` + (if present) ``tokenizer_config.json``.

        Control ids come from ``added_tokens_decoder`` when the config has one; ids of the 256-id block that it does
        not name become ``<|reserved_token_ID|>``.  Without a config, ``special_token_map(family, n_ranks)`` is used.
        """
        path = Path(path)
        model_file = path / "tiktoken.model"
        if not model_file.is_file():
            raise FileNotFoundError(f"{path}: no tiktoken.model (the tokenizer file of Kimi checkpoints)")
        ranks = load_tiktoken_ranks(model_file)
        base = max(ranks.values()) + 1
        specials: dict[str, int] | None = None
        cfg_file = path / "tokenizer_config.json"
        if cfg_file.is_file():
            try:
                cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise ValueError(f"{cfg_file}: cannot parse: {e}") from None
            added = cfg.get("added_tokens_decoder") if isinstance(cfg, dict) else None
            if isinstance(added, dict) and added:
                specials = {}
                for sid, entry in added.items():
                    content = entry.get("content") if isinstance(entry, dict) else entry
                    if not isinstance(content, str):
                        raise ValueError(f"{cfg_file}: added_tokens_decoder[{sid!r}] has no 'content' string")
                    try:
                        tid = int(sid)
                    except ValueError:
                        raise ValueError(f"{cfg_file}: added_tokens_decoder key {sid!r} is not an id") from None
                    if tid < base:
                        continue  # an added token that is an ordinary rank: nothing to add
                    specials[content] = tid
                used = set(specials.values())
                for tid in range(base, base + NUM_RESERVED_SPECIAL):
                    if tid not in used and _reserved_name(tid) not in specials:
                        specials[_reserved_name(tid)] = tid
        if specials is None:
            specials = special_token_map(family, base)
        return cls(ranks, specials, pat_str=pat_str)

    @classmethod
    def tiny(cls, family: str = "k3", vocab_size: int = TINY_NUM_RANKS + TINY_NUM_RESERVED) -> "Tokenizer":
        """The built-in tokenizer of the ``tiny`` preset: 1000 BPE ranks + 24 control ids (1024 in all).

        K3 layout: [BOS] 1000, [EOS] 1001, <|end_of_msg|> 1002, <|open|> 1003, <|close|> 1004, <|sep|> 1005,
        <|media_begin|> 1006, <|media_content|> 1007, <|media_end|> 1008, <|media_pad|> 1009, [PAD] 1023.
        ``family="k2"`` packs the <|im_*|> control tokens into the same block instead (for Kimi-Linear-format tests).
        A larger ``vocab_size`` (a random-weight preset at full size: 163840) keeps the 1000 ranks and makes every
        id above them a control token, the named ones first (checkpoint layout relative to the ranks), the rest
        ``<|reserved_token_ID|>``: text encodes into the first 1000 ids and every id decodes.
        """
        ranks = load_tiktoken_ranks(TINY_TIKTOKEN_PATH)
        if len(ranks) != TINY_NUM_RANKS:
            raise ValueError(f"{TINY_TIKTOKEN_PATH}: expected {TINY_NUM_RANKS} ranks, found {len(ranks)}")
        if vocab_size < TINY_NUM_RANKS + TINY_NUM_RESERVED:
            raise ValueError(f"the built-in tokenizer needs at least {TINY_NUM_RANKS + TINY_NUM_RESERVED} ids, "
                             f"got {vocab_size}")
        wide = vocab_size != TINY_NUM_RANKS + TINY_NUM_RESERVED
        return cls(ranks, special_token_map(family, TINY_NUM_RANKS, vocab_size - TINY_NUM_RANKS),
                   name=f"kimi_tiny_{family}" + (f"_{vocab_size}" if wide else ""))

    # ---------------------------------------------------------------- properties
    @property
    def vocab_size(self) -> int:
        """Number of ids (BPE ranks + control block): 163840 for the Kimi checkpoints, 1024 for ``tiny``."""
        return self._vocab_size

    @property
    def num_ranks(self) -> int:
        """Number of ordinary (BPE) tokens."""
        return self._num_ranks

    @property
    def special_tokens(self) -> dict[str, int]:
        """``{name: id}`` of every control token (reserved placeholders included)."""
        return dict(self._special)

    @property
    def encoding(self) -> tiktoken.Encoding:
        return self._enc

    def _first_special(self, names: Iterable[str]) -> int | None:
        for n in names:
            if n in self._special:
                return self._special[n]
        return None

    @property
    def eos_id(self) -> int:
        """End-of-turn id: ``<|end_of_msg|>`` (K3), else ``<|im_end|>`` (K2), else ``[EOS]``."""
        tid = self._first_special(_EOS_PREFERENCE)
        if tid is None:
            raise ValueError("tokenizer has no end-of-message control token")
        return tid

    @property
    def bos_id(self) -> int | None:
        return self._first_special(("[BOS]", "<｜begin▁of▁sentence｜>"))

    @property
    def pad_id(self) -> int | None:
        return self._special.get("[PAD]")

    @property
    def stop_ids(self) -> frozenset[int]:
        """Every id that ends generation (end of message, [EOS], [EOT] where present)."""
        return frozenset(self._special[n] for n in _STOP_NAMES if n in self._special)

    def token_id(self, name: str) -> int:
        """Id of a control token by name, or of an ordinary token whose bytes are exactly ``name``."""
        if name in self._special:
            return self._special[name]
        rank = self._ranks.get(name.encode("utf-8"))
        if rank is not None:
            return rank
        raise KeyError(f"no token named {name!r} in tokenizer {self.name!r}")

    def has_token(self, name: str) -> bool:
        return name in self._special

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_by_id

    def special_name(self, token_id: int) -> str | None:
        return self._special_by_id.get(token_id)

    # ---------------------------------------------------------------- encode / decode
    def encode(self, text: str) -> list[int]:
        """Ordinary BPE ids for ``text``; control-token spellings in the text are encoded as plain text.  Long runs
        and long texts are encoded in pieces (`encode_pieces`, module docstring)."""
        if len(text) <= MAX_RUN_CHARS:  # the common case: nothing to cut
            return self._enc.encode(text, allowed_special=set(), disallowed_special=())
        ids: list[int] = []
        for piece in encode_pieces(text):
            ids += self._enc.encode(piece, allowed_special=set(), disallowed_special=())
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        """Bytes of one id: the BPE bytes, a control token's name, or ``b""`` for an unknown id."""
        sb = self._special_bytes.get(token_id)
        if sb is not None:
            return sb
        if 0 <= token_id < self._vocab_size:
            try:
                return self._enc.decode_single_token_bytes(token_id)
            except KeyError:
                return b""
        return b""

    def decode_bytes(self, ids: Iterable[int], *, skip_special: bool = False) -> bytes:
        """Concatenated bytes of ``ids``; control tokens as their names (or dropped with ``skip_special``)."""
        ids = [int(i) for i in ids]
        if skip_special:
            ids = [i for i in ids if i not in self._special_by_id]
        try:
            return self._enc.decode_bytes(ids)
        except (KeyError, OverflowError, ValueError, TypeError):
            return b"".join(self.token_bytes(i) for i in ids)

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """Text of ``ids`` (invalid UTF-8 becomes U+FFFD)."""
        return self.decode_bytes(ids, skip_special=skip_special).decode("utf-8", errors="replace")

    def stream_decoder(self, *, skip_special: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, skip_special=skip_special)

    def __repr__(self) -> str:
        return f"Tokenizer(name={self.name!r}, ranks={self._num_ranks}, vocab_size={self._vocab_size})"


class StreamDecoder:
    """Incremental detokeniser: ``push(id)`` returns the text that became complete with this token.

    Bytes of a character split across tokens are held until the character is complete.  A control token first
    flushes held bytes (an unfinished character becomes U+FFFD) and then yields its name (nothing with
    ``skip_special``).  ``flush()`` ends the stream.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = False):
        self._tok = tokenizer
        self._skip_special = skip_special
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held = 0  # bytes pushed but not yet emitted (approximate; for `pending`)

    def push(self, token_id: int) -> str:
        token_id = int(token_id)
        name = self._tok.special_name(token_id)
        if name is not None:
            text = self.flush()
            return text if self._skip_special else text + name
        return self.push_bytes(self._tok.token_bytes(token_id))

    def push_many(self, ids: Iterable[int]) -> str:
        return "".join(self.push(i) for i in ids)

    def push_bytes(self, data: bytes) -> str:
        text = self._dec.decode(data, final=False)
        buffered, _ = self._dec.getstate()
        self._held = len(buffered)
        return text

    @property
    def pending(self) -> bool:
        """True while bytes of an unfinished character are held."""
        return self._held > 0

    def flush(self) -> str:
        text = self._dec.decode(b"", final=True)
        self._dec.reset()
        self._held = 0
        return text
