"""Build ``tiny_tiktoken.model``: the 1000-rank byte-level BPE vocabulary of the ``tiny`` preset.

Run from the repository root:  ``python kimi_jax/data/make_tiny_tokenizer.py [--check]``

Ranks 0..255 are the single bytes (so any UTF-8 text round-trips), ranks 256..999 are merges learned by a small,
deterministic byte-pair learner on the built-in corpus below (English prose, Python/JSON code, the chat-format
words, and some non-Latin text and emoji).  The learner:

  1. splits the corpus into pieces with the tokenizer's pre-tokenisation regex (``KIMI_PAT_STR``);
  2. counts adjacent token pairs inside pieces, weighted by piece frequency;
  3. merges the most frequent pair (ties: the pair whose bytes sort first), gives the merged bytes the next rank
     (unless those bytes are already a token), and repeats until there are 1000 ranks.

The result is stable across runs and platforms; ``--check`` rebuilds in memory and compares with the stored file.
The 24 ids 1000..1023 are the control tokens (see ``kimi_jax.tokenizer.Tokenizer.tiny``).
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import regex

_HERE = Path(__file__).resolve().parent
if __package__ in (None, ""):
    sys.path.insert(0, str(_HERE.parent.parent))

from kimi_jax.tokenizer import (  # noqa: E402
    KIMI_PAT_STR,
    TINY_NUM_RANKS,
    load_tiktoken_ranks,
    save_tiktoken_ranks,
)

OUT_PATH = _HERE / "tiny_tiktoken.model"

CORPUS = r'''
The tiny model is a small copy of the large one. It has the same layers, the same attention, and the same router,
but every matrix is small enough to run on a laptop. We use it to test the server, the cache, and the tokenizer.
When you ask the server a question, it builds a prompt from your messages, runs the model, and streams the answer
back to you, one token at a time. The answer is made of reasoning, content, and tool calls.

Once upon a time there was a little robot who wanted to learn how to read. Every morning the robot opened a book
and looked at the letters. At first they were only shapes, but slowly the shapes became words, and the words became
stories. "What is this story about?" asked the teacher. "It is about a river that wanted to reach the sea," said the
robot. The teacher smiled. "Then keep reading, and tell me where the river goes."

Please write a function that returns the sum of the numbers in a list. Then explain how it works, and what happens
when the list is empty. Think step by step before you answer, and check your work at the end.
The weather today is sunny with a light wind from the west. Tomorrow there will be rain in the morning and clouds
in the afternoon. The temperature will be between 12 and 18 degrees, and the humidity will stay near 60 percent.

I think the best way to solve this problem is to split it into smaller parts. First, we read the input. Second, we
check that it is valid. Third, we compute the result. Finally, we write the output and return the status code.
Let's consider the case where the input is very large: we should not read all of it into memory at once.
You're right that it wouldn't work; we'll need another approach. They've already tried it, and I'd say it's done.

def add(a: int, b: int) -> int:
    """Return the sum of a and b."""
    return a + b


def mean(values: list[float]) -> float:
    if not values:
        raise ValueError("mean of an empty list")
    total = 0.0
    for value in values:
        total += value
    return total / len(values)


class Counter:
    def __init__(self, start: int = 0) -> None:
        self.count = start

    def increment(self, step: int = 1) -> int:
        self.count += step
        return self.count

    def __repr__(self) -> str:
        return f"Counter(count={self.count})"


for i in range(10):
    if i % 2 == 0:
        print(i, "is even")
    else:
        print(i, "is odd")

import json
import numpy as np

data = {"name": "kimi", "version": 3, "layers": [0, 1, 2, 3], "enabled": True, "score": 0.75, "extra": None}
text = json.dumps(data, indent=2)
array = np.zeros((4, 8), dtype=np.float32)
result = [x * x for x in range(100) if x > 10]

{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
 "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city name"},
 "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}
{"type": "function", "function": {"name": "search", "description": "Search the web for a query",
 "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "number"}}}}}

message role="system" message role="user" message role="assistant" message role="tool" name="get_weather"
think response tools call tool="search" index="1" argument key="query" type="string" argument key="limit"
type="number" type="boolean" type="null" type="object" type="array" json type="object" type="tool-declare"
type="thinking-effort" low high max # Tools

SELECT id, name, created_at FROM users WHERE active = 1 ORDER BY created_at DESC LIMIT 20;
git commit -m "Fix the cache size" && git push origin main
https://example.com/api/v1/chat/completions?model=tiny&stream=true
for (int i = 0; i < n; ++i) { sum += x[i] * y[i]; }
if (err != nil) { return nil, fmt.Errorf("read %s: %w", path, err) }
const answer = await fetch(url, { method: "POST", headers: { "Content-Type": "application/json" } });

The quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 2048 3.14159 2.71828 1e-5 -7 +8 50% $19.99 #1 @user
Dates: 2024-01-15, 2025-06-30 12:45:00, March 3rd, Monday, Tuesday, Wednesday, Thursday, Friday.

Le café est très bon, et la crème brûlée aussi. Où est la gare? À bientôt, mon ami. Ça va très bien, merci.
Das Mädchen läuft schnell über die Straße. Grüße aus München! Schöne Grüße und vielen Dank.
El niño comió una manzana en la mañana. ¿Dónde está la biblioteca? ¡Qué bueno!
Привет, как дела? Сегодня хорошая погода. Спасибо большое, до свидания.
Γειά σου κόσμε. Καλημέρα σας. Ευχαριστώ πολύ.
你好，世界！今天天气很好。我们一起去学习吧。这是一个小模型，用来测试服务器和分词器。人工智能正在改变世界。
こんにちは、世界。今日はいい天気ですね。ありがとうございます。日本語の文章も少し入れておきます。
안녕하세요, 세계. 오늘 날씨가 좋네요. 감사합니다.
مرحبا بالعالم. شكرا جزيلا.   नमस्ते दुनिया। धन्यवाद।   שלום עולם. תודה רבה.
Emoji: 😀 😃 😄 😁 😆 🙂 🙃 😉 😊 👍 👋 🎉 🚀 ❤️ ✨ 🔥 🌍 🤖 🐍 ☕ ✅ ❌ ⚠️ 👨‍👩‍👧 🇯🇵 🇫🇷
Math: α β γ δ ε λ μ π σ ω ∑ ∫ √ ∞ ≈ ≠ ≤ ≥ → ← ↑ ↓ × ÷ ± ° ² ³ ½ ¼ € £ ¥ © ® ™ … — – • · “quoted” ‘single’

Question: How many legs does a spider have? Answer: A spider has eight legs.
Question: What is the capital of France? Answer: The capital of France is Paris.
Question: What is two plus two? Answer: Two plus two is four.
Question: Who wrote the play about the prince of Denmark? Answer: William Shakespeare wrote Hamlet.
User: Can you help me plan a trip to the mountains next week?
Assistant: Of course! Let me check the weather first, and then I will suggest a route, a place to stay, and what
to pack. You should bring warm clothes, good shoes, water, and a map, because the signal can be weak up there.
User: Thanks, that is very helpful. What time should we start in the morning?
Assistant: Start early, around seven o'clock, so that you reach the top before the afternoon storms.

In machine learning, a model learns a function from examples. The training data contains inputs and targets, and
the optimizer changes the weights to make the predictions closer to the targets. A transformer uses attention to
mix information between tokens; a linear attention layer keeps a fixed-size state instead of a growing cache.
The key, the query, and the value are projections of the hidden state. The gate decides how much of the old state
to keep. The router sends each token to a few experts, and the experts are small feed-forward networks.
Tokens are pieces of text. A tokenizer splits text into tokens and maps each token to an integer id.
Special tokens mark the start and the end of a message; they are never produced from user text.
'''


def train_ranks(corpus: str, num_ranks: int = TINY_NUM_RANKS) -> dict[bytes, int]:
    """Byte-level BPE: 256 byte tokens, then learned merges until ``num_ranks`` tokens exist."""
    ranks: dict[bytes, int] = {bytes([b]): b for b in range(256)}
    piece_counts = collections.Counter(
        p.encode("utf-8") for p in regex.findall(KIMI_PAT_STR, corpus, flags=regex.V1)
    )
    # each distinct piece as a list of current tokens, with its frequency; sorted for determinism
    words: list[tuple[list[bytes], int]] = [
        ([bytes([b]) for b in piece], n) for piece, n in sorted(piece_counts.items())
    ]
    while len(ranks) < num_ranks:
        pairs: collections.Counter[tuple[bytes, bytes]] = collections.Counter()
        for toks, n in words:
            for a, b in zip(toks, toks[1:]):
                pairs[(a, b)] += n
        if not pairs:
            raise RuntimeError(f"corpus too small: only {len(ranks)} tokens could be learned")
        (a, b), _ = min(pairs.items(), key=lambda kv: (-kv[1], kv[0][0] + kv[0][1], kv[0][0]))
        merged = a + b
        if merged not in ranks:
            ranks[merged] = len(ranks)
        for toks, _n in words:
            i = 0
            while i < len(toks) - 1:
                if toks[i] == a and toks[i + 1] == b:
                    toks[i : i + 2] = [merged]
                i += 1
    return ranks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="rebuild in memory and compare with the stored file")
    ap.add_argument("--out", default=str(OUT_PATH))
    args = ap.parse_args(argv)
    ranks = train_ranks(CORPUS)
    assert sorted(ranks.values()) == list(range(TINY_NUM_RANKS))
    if args.check:
        stored = load_tiktoken_ranks(args.out)
        if stored != ranks:
            print(f"{args.out} differs from a fresh build", file=sys.stderr)
            return 1
        print(f"{args.out}: up to date ({len(ranks)} ranks)")
        return 0
    save_tiktoken_ranks(ranks, args.out)
    print(f"wrote {args.out}: {len(ranks)} ranks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
