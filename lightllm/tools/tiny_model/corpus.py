"""A small built-in training text for the tiny byte-level BPE tokenizer (fixed, so training is deterministic)."""

from __future__ import annotations

import random

_PARAGRAPHS = (
    "A hybrid model mixes linear attention layers with a few full attention layers. The linear layers keep a "
    "fixed-size state per request, so memory does not grow with the length of the conversation.",
    "The server reads a prompt, turns the text into tokens, runs the model one step at a time and streams the "
    "answer back to the client. Every step produces one new token for every running request.",
    "Hello! How are you today? I am fine, thank you. What would you like to talk about? Let us count: one, two, "
    "three, four, five, six, seven, eight, nine, ten.",
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step. "
    "Water boils at 100 degrees Celsius and freezes at 0 degrees.",
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(add(i, 2 * i))\n",
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    "Speculative decoding drafts several tokens cheaply and verifies them in one forward pass of the large model; "
    "accepted tokens are kept and the state is rolled back to the last accepted position.",
    "今天天气很好。我们去公园散步吧。模型生成文本。",
    "Ceci est une phrase en français. Das ist ein deutscher Satz. Esto es una frase en español.",
)

_SYLLABLES = (
    "ka",
    "to",
    "ri",
    "mu",
    "sen",
    "lo",
    "va",
    "pre",
    "dit",
    "ion",
    "ar",
    "el",
    "qu",
    "tra",
    "ne",
    "so",
    "bi",
    "cal",
    "mor",
    "ex",
    "un",
    "der",
    "st",
    "ph",
    "ing",
    "ed",
    "ly",
    "ous",
    "ght",
    "zo",
)


def training_corpus(num_generated_lines: int = 400) -> list[str]:
    """Fixed paragraphs plus pseudo-words from a fixed-seed generator, so the BPE trainer has enough pairs to merge."""
    rng = random.Random(20240531)
    # The fixed paragraphs are repeated so that common English merges come before pseudo-word merges.
    lines = list(_PARAGRAPHS) * 20
    for _ in range(num_generated_lines):
        words = []
        for _ in range(rng.randint(6, 14)):
            word = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4)))
            words.append(word.capitalize() if rng.random() < 0.15 else word)
        lines.append(" ".join(words) + rng.choice((".", ",", "?", "!", f" {rng.randint(0, 9999)}.")))
    return lines
