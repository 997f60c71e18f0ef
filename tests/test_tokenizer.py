"""Tokenizer: the built-in tiny vocabulary, control tokens, tiktoken.model loading, streaming detokenisation."""

import base64
import json
import random

import pytest

from kimi_jax.tokenizer import (
    K2_SPECIAL_OFFSETS,
    TINY_TIKTOKEN_PATH,
    StreamDecoder,
    Tokenizer,
    load_tiktoken_ranks,
    save_tiktoken_ranks,
    special_token_map,
)

K3_IDS = {
    "[BOS]": 163584,
    "[EOS]": 163585,
    "<|end_of_msg|>": 163586,
    "<|open|>": 163587,
    "<|close|>": 163588,
    "<|sep|>": 163589,
    "<|media_begin|>": 163602,
    "<|media_content|>": 163603,
    "<|media_end|>": 163604,
    "<|media_pad|>": 163605,
    "[PAD]": 163839,
}

TINY_IDS = {
    "[BOS]": 1000,
    "[EOS]": 1001,
    "<|end_of_msg|>": 1002,
    "<|open|>": 1003,
    "<|close|>": 1004,
    "<|sep|>": 1005,
    "<|media_begin|>": 1006,
    "<|media_content|>": 1007,
    "<|media_end|>": 1008,
    "<|media_pad|>": 1009,
    "[PAD]": 1023,
}

SAMPLES = [
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.\n\n  indented\tand tabbed  ",
    "naïve café, Grüße, ¿Dónde? Привет, мир! Γειά σου",
    "你好，世界！人工智能正在改变世界。こんにちは 안녕하세요",
    "emoji 😀🚀 family 👨‍👩‍👧 flags 🇯🇵 keycap 1️⃣ skin 👍🏽",
    "combining e\u0301 and zero\u200bwidth and NUL \x00 and DEL \x7f",
    "math 𝄞 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∑∫√∞",
    'def f(x):\n    return {"a": [1, 2.5, None]}  # comment\n',
    "<|open|>message role=\"user\"<|sep|>hi<|close|>message<|sep|><|end_of_msg|>[BOS][PAD]",
]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.tiny()


def test_tiny_layout(tok):
    assert tok.vocab_size == 1024
    assert tok.num_ranks == 1000
    for name, tid in TINY_IDS.items():
        assert tok.special_tokens[name] == tid
        assert tok.token_id(name) == tid
    assert tok.eos_id == 1002 and tok.bos_id == 1000 and tok.pad_id == 1023
    assert tok.stop_ids == {1001, 1002}
    # every id of the vocabulary decodes without error
    assert len(tok.decode(list(range(1024)))) > 0
    assert all(tok.token_bytes(i) for i in range(1024))


def test_every_byte_is_a_token():
    ranks = load_tiktoken_ranks(TINY_TIKTOKEN_PATH)
    assert sorted(ranks.values()) == list(range(1000))
    for b in range(256):
        assert ranks[bytes([b])] == b
    assert TINY_TIKTOKEN_PATH.stat().st_size < 64 * 1024


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.num_ranks for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode_bytes(ids) == text.encode("utf-8")


def test_round_trip_random_unicode(tok):
    rng = random.Random(0)
    for _ in range(50):
        chars = []
        for _ in range(rng.randint(1, 40)):
            cp = rng.choice([rng.randint(0x20, 0x7E), rng.randint(0x80, 0x7FF), rng.randint(0x800, 0xD7FF),
                             rng.randint(0xE000, 0xFFFF), rng.randint(0x10000, 0x10FFFF)])
            chars.append(chr(cp))
        text = "".join(chars)
        assert tok.decode(tok.encode(text)) == text


def test_merges_compress_common_text(tok):
    text = "The model returns the answer to the user."
    assert len(tok.encode(text)) < len(text.encode()) * 0.6


def test_long_runs_and_long_texts_encode_in_pieces(tok):
    """A run of ~1M spaces made tiktoken's regex engine give up ("Max stack size exceeded for backtracking"; the
    server answered 500). As in the Kimi / Llama 3 tokenizers, runs longer than 25,000 characters are cut every
    25,000 characters and text is encoded in 400,000-character windows; every input still round-trips."""
    from kimi_jax.tokenizer import MAX_RUN_CHARS, MAX_WINDOW_CHARS, encode_pieces

    assert MAX_RUN_CHARS == 25_000 and MAX_WINDOW_CHARS == 400_000
    assert [len(p) for p in encode_pieces("x" * 25_001 + " " * 50_001)] == [25_000, 25_001, 25_000, 1]
    assert encode_pieces("short text") == ["short text"]
    assert [len(p) for p in encode_pieces("ab " * 200_000)] == [400_000, 200_000]
    for text in (" " * 1_000_000, "\t" * 999_999, "a" * 60_000 + "\n" * 30_000 + "b"):
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert ids == [i for p in encode_pieces(text) for i in tok.encode(p)]
    text = "hello world, " * 2_000  # under the limits: one piece, as before
    assert tok.encode(text) == tok._enc.encode(text, allowed_special=set(), disallowed_special=())


def test_control_spellings_are_plain_text(tok):
    for name, tid in TINY_IDS.items():
        ids = tok.encode(f"before {name} after")
        assert tid not in ids
        assert not any(tok.is_special(i) for i in ids)
        assert tok.decode(ids) == f"before {name} after"


def test_decode_special_and_unknown_ids(tok):
    ids = [1003] + tok.encode("think") + [1005]
    assert tok.decode(ids) == "<|open|>think<|sep|>"
    assert tok.decode(ids, skip_special=True) == "think"
    assert tok.decode([1010]) == "<|reserved_token_1010|>"
    # ids outside the vocabulary never raise
    assert tok.decode([5000, -1] + tok.encode("x")) == "x"


def test_token_id_of_ordinary_token(tok):
    assert tok.token_id("a") == ord("a")
    with pytest.raises(KeyError):
        tok.token_id("<|no_such_token|>")


def test_stream_decoder_split_multibyte(tok):
    char = "𝄞"  # 4 UTF-8 bytes, not in the training corpus: one byte per token
    ids = tok.encode(char)
    assert len(ids) >= 2
    dec = tok.stream_decoder()
    pieces = [dec.push(i) for i in ids]
    assert pieces[:-1] == [""] * (len(ids) - 1)
    assert pieces[-1] == char
    assert not dec.pending
    assert dec.flush() == ""


@pytest.mark.parametrize("text", SAMPLES)
def test_stream_decoder_never_emits_partial_chars(tok, text):
    dec = StreamDecoder(tok)
    pieces = [dec.push(i) for i in tok.encode(text)]
    pieces.append(dec.flush())
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_stream_decoder_control_token_mid_character(tok):
    dec = StreamDecoder(tok)
    first = tok.encode("é")  # 2 bytes
    raw = "é".encode()
    assert dec.push_bytes(raw[:1]) == ""
    assert dec.pending
    out = dec.push(1004)
    assert out == "\ufffd<|close|>"
    assert dec.push_many(first) == "é"
    dec2 = StreamDecoder(tok, skip_special=True)
    assert dec2.push(1004) == ""


def test_special_token_map_k3_real_ids():
    m = special_token_map("k3", 163584)
    for name, tid in K3_IDS.items():
        assert m[name] == tid
    assert len(m) == 256
    assert sorted(m.values()) == list(range(163584, 163840))


def test_special_token_map_k2_real_ids():
    m = special_token_map("kimi_linear", 163584)
    assert m["<|im_end|>"] == 163586
    assert m["<|im_user|>"] == 163587
    assert m["<|im_assistant|>"] == 163588
    assert m["<|im_system|>"] == 163594
    assert m["<|im_middle|>"] == 163601
    assert m["<|tool_calls_section_begin|>"] == 163595
    assert m["<|tool_call_end|>"] == 163599
    assert m["[UNK]"] == 163838 and m["[PAD]"] == 163839
    assert "<think>" not in m
    assert special_token_map("k2", 163584, think_tokens=True)["</think>"] == 163607


def test_special_token_map_compact():
    m = special_token_map("k3", 1000, 24)
    for name, tid in TINY_IDS.items():
        assert m[name] == tid
    k2 = special_token_map("k2", 1000, 24)
    assert k2["<|im_end|>"] == 1002 and k2["[PAD]"] == 1023 and k2["[UNK]"] == 1022
    assert sorted(k2.values()) == list(range(1000, 1024))
    with pytest.raises(ValueError):
        special_token_map("k2", 1000, 8)
    with pytest.raises(ValueError):
        special_token_map("gpt", 1000)


def test_from_file_and_from_dir(tmp_path):
    ranks = load_tiktoken_ranks(TINY_TIKTOKEN_PATH)
    save_tiktoken_ranks(ranks, tmp_path / "tiktoken.model")
    assert load_tiktoken_ranks(tmp_path / "tiktoken.model") == ranks

    t = Tokenizer.from_file(tmp_path / "tiktoken.model")  # default: K3 map over 1000 ranks, 256-id block
    assert t.vocab_size == 1256
    assert t.token_id("<|open|>") == 1003 and t.token_id("[PAD]") == 1255

    # without tokenizer_config.json
    t2 = Tokenizer.from_dir(tmp_path, family="k2")
    assert t2.token_id("<|im_middle|>") == 1017

    # with added_tokens_decoder (the checkpoint's names win; the rest of the block is reserved)
    added = {str(1000 + off): {"content": name, "special": True} for name, off in K2_SPECIAL_OFFSETS.items()}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": added}))
    t3 = Tokenizer.from_dir(tmp_path)
    assert t3.token_id("<|im_end|>") == 1002
    assert t3.token_id("<|tool_call_begin|>") == 1013
    assert t3.token_id("<|reserved_token_1005|>") == 1005
    assert t3.vocab_size == 1256
    assert t3.eos_id == 1002
    assert t3.decode(t3.encode("hi <|im_end|>")) == "hi <|im_end|>"


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_dir(tmp_path)
    bad = tmp_path / "bad.model"
    bad.write_text(base64.b64encode(b"a").decode() + " 0\nnot-a-line\n")
    with pytest.raises(ValueError, match="bad.model:2"):
        load_tiktoken_ranks(bad)
    dup = tmp_path / "dup.model"
    dup.write_text(base64.b64encode(b"a").decode() + " 0\n" + base64.b64encode(b"b").decode() + " 0\n")
    with pytest.raises(ValueError, match="twice"):
        load_tiktoken_ranks(dup)
    ranks = {bytes([b]): b for b in range(256)}
    with pytest.raises(ValueError, match="collide"):
        Tokenizer(ranks, {"<|open|>": 5})
    with pytest.raises(ValueError, match="single-byte"):
        Tokenizer({b"a": 0}, {})


def test_the_built_in_tokenizer_widens_to_a_full_size_vocabulary():
    """A random-weight preset at full size (163840 ids) is served by the 1000 tiny ranks with every other id a
    control token: text encodes as before, the named control tokens sit where the checkpoint layout puts them
    relative to the ranks, [PAD] at the top, and every id decodes."""
    from kimi_jax.tokenizer import Tokenizer

    tiny, wide = Tokenizer.tiny("k2"), Tokenizer.tiny("k2", vocab_size=163840)
    assert wide.vocab_size == 163840 and wide.num_ranks == tiny.num_ranks == 1000
    assert wide.encode("hello world") == tiny.encode("hello world")
    assert wide.special_tokens["[PAD]"] == 163839 and wide.eos_id == wide.special_tokens["<|im_end|>"] < 1256
    assert wide.decode([150000]) == "<|reserved_token_150000|>"
