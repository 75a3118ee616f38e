"""Training examples and batches of the demo model, in a fixed order.

Each source file is cut at its top-level `def` / `class` lines into snippets. Every other snippet is written as a
chat turn (the user names the definition, the assistant writes it, under the checkpoint's chat template with the
thinking block closed), the rest as plain text, so both /v1/completions and /v1/chat/completions get code back.
Snippets are joined with `<|endoftext|>` into one token stream; batches are windows at seeded random offsets.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

from .corpus import Document

_TOP_LEVEL = re.compile(r"^(?:async def |def |class )", re.MULTILINE)
END_OF_TEXT = "<|endoftext|>"


def snippets(doc: Document) -> list[str]:
    """`doc` cut before each top-level definition (the module header stays with the first piece)."""
    starts = [m.start() for m in _TOP_LEVEL.finditer(doc.text) if m.start() > 0]
    bounds = [0, *starts, len(doc.text)]
    return [doc.text[a:b] for a, b in zip(bounds, bounds[1:]) if doc.text[a:b].strip()]


def chat_example(module: str, snippet: str) -> str:
    """A user turn naming the snippet's first line, the assistant's turn writing the snippet."""
    head = snippet.lstrip().splitlines()[0].rstrip(":").strip()
    return (
        f"<|im_start|>user\nWrite `{head}` from the Python module {module}.<|im_end|>\n"
        f"<|im_start|>assistant\n<think>\n\n</think>\n\n{snippet.strip()}<|im_end|>\n"
    )


def examples(docs: list[Document]) -> Iterator[str]:
    """Every snippet of `docs`, alternating chat and plain text, in document order."""
    i = 0
    for doc in docs:
        module = doc.name.removesuffix(".py").replace("/", ".")
        for piece in snippets(doc):
            yield chat_example(module, piece) if i % 2 else piece
            i += 1


def token_stream(tokenizer, docs: list[Document]) -> torch.Tensor:
    """All examples encoded and joined by `<|endoftext|>`: one int32 tensor."""
    eot = tokenizer.token_to_id(END_OF_TEXT)
    texts = list(examples(docs))
    ids: list[int] = []
    for enc in tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.int32)


class Batches:
    """Windows of `seq_len` tokens from `stream` at offsets drawn from a generator seeded with `seed`."""

    def __init__(self, stream: torch.Tensor, batch_size: int, seq_len: int, seed: int):
        if stream.numel() <= seq_len:
            raise ValueError(f"token stream of {stream.numel()} tokens is shorter than seq_len {seq_len}")
        self.stream, self.batch_size, self.seq_len = stream, batch_size, seq_len
        self.generator = torch.Generator().manual_seed(seed)

    def next(self) -> torch.Tensor:
        """`[batch_size, seq_len]` int64 token ids."""
        starts = torch.randint(0, self.stream.numel() - self.seq_len, (self.batch_size,), generator=self.generator)
        return torch.stack([self.stream[s : s + self.seq_len] for s in starts.tolist()]).long()
