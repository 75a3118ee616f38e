"""Kimi's tiktoken-format tokenizer, read from the checkpoint folder by this project (no remote code).

The folder holds `tiktoken.model` (one `base64(token bytes) rank` per line: the byte-level BPE, merged by rank)
and `tokenizer_config.json` (`added_tokens_decoder`: the special tokens and their ids, which follow the BPE
ranks; `bos_token` / `eos_token`; `chat_template`, or a `chat_template.jinja` file). The pre-tokenizer is Kimi's
split pattern: the released tokenizer hard-codes it rather than writing it to a file. Encoding is `tiktoken`'s,
the BPE library the released tokenizer itself runs, so ids match it exactly.
"""

from __future__ import annotations

import base64
import binascii
import os
from collections.abc import Iterator
from dataclasses import dataclass

from lightllm.server.checkpoint_check import read_json

RANKS_FILE = "tiktoken.model"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
# Kimi's pre-tokenizer: Han runs, cased words (`&&` intersects character classes), digits by three, punctuation
# runs, newlines and spaces
KIMI_PATTERN = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
# the format reserves this many ids after the BPE ranks for special tokens; unnamed ones are <|reserved_token_ID|>
NUM_RESERVED_SPECIAL = 256
# tiktoken's encoder panics on texts past ~400k characters and slows down quadratically on very long runs of
# (non-)whitespace, so text is encoded in pieces cut at these lengths (the released tokenizer cuts the same way)
MAX_ENCODE_CHARS = 400_000
MAX_RUN_CHARS = 25_000


def is_tiktoken_folder(model_dir: str) -> bool:
    """A checkpoint whose tokenizer is `tiktoken.model` (a `tokenizer.json` wins when both are present)."""
    return os.path.isfile(os.path.join(model_dir, RANKS_FILE)) and not os.path.isfile(
        os.path.join(model_dir, "tokenizer.json")
    )


def read_ranks(path: str) -> dict[bytes, int]:
    """`tiktoken.model` -> token bytes to rank; ValueError naming the file and line when it is malformed."""
    ranks: dict[bytes, int] = {}
    seen_ranks: set[int] = set()
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            parts = line.split()
            if len(parts) != 2 or not parts[1].isdigit():
                raise ValueError(f"{path} line {lineno}: expected 'base64-token rank', found {line[:80]!r}")
            try:
                token = base64.b64decode(parts[0], validate=True)
            except binascii.Error:
                raise ValueError(f"{path} line {lineno}: expected a base64 token, found {parts[0][:80]!r}") from None
            rank = int(parts[1])
            if token in ranks or rank in seen_ranks:
                raise ValueError(f"{path} line {lineno}: token {token!r} or rank {rank} appears twice")
            ranks[token] = rank
            seen_ranks.add(rank)
    if not ranks:
        raise ValueError(f"{path}: expected BPE ranks, found an empty file")
    # byte-level BPE starts every piece from its single bytes: tiktoken panics on a text holding a byte without a
    # rank, so a file lacking one would pass here and fail on the first request that contains it
    missing = [bytes([b]) for b in range(256) if bytes([b]) not in ranks]
    if missing:
        shown = " ".join(repr(b) for b in missing[:8]) + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else "")
        raise ValueError(f"{path}: expected a rank for each of the 256 single bytes, found none for {shown}")
    # the special tokens take the ids after the ranks (as the released tokenizer numbers them): a gap would
    # give a special token the id of a rank
    if max(seen_ranks) != len(ranks) - 1:
        gap = min(set(range(len(ranks))) - seen_ranks)
        raise ValueError(f"{path}: expected ranks 0..{len(ranks) - 1} without gaps, found no token of rank {gap}")
    return ranks


def _content(value) -> str | None:
    """A token as tokenizer_config.json spells it: a string, or an AddedToken object with `content`."""
    if isinstance(value, dict):
        return value.get("content")
    return value


@dataclass(frozen=True)
class SpecialTokens:
    """Special token text -> id, and the ids that `skip_special_tokens` drops."""

    ids: dict[str, int]
    skipped: frozenset[int]


def read_special_tokens(config: dict, num_ranks: int, path: str) -> SpecialTokens:
    """The special tokens of `tokenizer_config.json`'s `added_tokens_decoder`, ids after the BPE ranks; the
    reserved ids it leaves unnamed become `<|reserved_token_ID|>`."""
    added = config.get("added_tokens_decoder") or {}
    named: dict[int, str] = {}
    kept: set[int] = set()
    for key, entry in added.items():
        token_id, text = int(key), _content(entry)
        if not isinstance(text, str) or not text:
            raise ValueError(f"{path}: added_tokens_decoder[{key}]: expected a token with content, found {entry!r}")
        if token_id < num_ranks:
            raise ValueError(
                f"{path}: added_tokens_decoder[{key}] ({text!r}): expected an id >= {num_ranks} (after the "
                f"{num_ranks} BPE ranks of {RANKS_FILE}), found {token_id}"
            )
        named[token_id] = text
        if isinstance(entry, dict) and entry.get("special") is False:
            kept.add(token_id)
    top = max([num_ranks + NUM_RESERVED_SPECIAL - 1, *named])
    ids: dict[str, int] = {}
    for token_id in range(num_ranks, top + 1):
        text = named.get(token_id, f"<|reserved_token_{token_id}|>")
        if text in ids:
            raise ValueError(f"{path}: special token {text!r} has two ids, {ids[text]} and {token_id}")
        ids[text] = token_id
    return SpecialTokens(ids, frozenset(i for i in ids.values() if i not in kept))


def read_chat_template(model_dir: str, config: dict) -> str | None:
    """`chat_template.jinja` when present (it takes precedence, as in transformers), else the config's (a string
    or a list of named templates, of which "default" is used)."""
    path = os.path.join(model_dir, TEMPLATE_FILE)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        return named.get("default")
    return template


def split_long_runs(text: str) -> Iterator[str]:
    """`text` in pieces of at most MAX_ENCODE_CHARS characters, none holding a run of more than MAX_RUN_CHARS
    whitespace or non-whitespace characters."""
    for start in range(0, len(text), MAX_ENCODE_CHARS):
        piece = text[start : start + MAX_ENCODE_CHARS]
        run, is_space, cut = 0, piece[:1].isspace(), 0
        for i, ch in enumerate(piece):
            if ch.isspace() != is_space:
                run, is_space = 1, ch.isspace()
                continue
            run += 1
            if run > MAX_RUN_CHARS:
                yield piece[cut:i]
                cut, run = i, 1
        yield piece[cut:]


def _sorted_keys(value):
    """Tool schemas with every dict's keys sorted, as the released tokenizer renders them."""
    if isinstance(value, dict):
        return {k: _sorted_keys(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [_sorted_keys(v) for v in value]
    return value


class TiktokenTokenizer:
    """A tiktoken-format checkpoint tokenizer with the calls `lightllm.server.tokenizer.Tokenizer` makes of a
    Hugging Face tokenizer (`encode`, `decode`, `apply_chat_template`, `chat_template`, `eos_token_id`, `len`)."""

    def __init__(self, model_dir: str):
        import tiktoken

        config_path = os.path.join(model_dir, CONFIG_FILE)
        config = read_json(config_path) if os.path.isfile(config_path) else {}
        ranks = read_ranks(os.path.join(model_dir, RANKS_FILE))
        self.special = read_special_tokens(config, len(ranks), config_path)
        self.encoding = tiktoken.Encoding(
            name=os.path.basename(os.path.normpath(model_dir)) or "checkpoint",
            pat_str=KIMI_PATTERN,
            mergeable_ranks=ranks,
            special_tokens=self.special.ids,
        )
        self.chat_template = read_chat_template(model_dir, config)
        # the template sees these as variables, as transformers passes a tokenizer's special tokens map
        self.template_tokens = {
            name: _content(config[name])
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
            if isinstance(_content(config.get(name)), str)
        }
        eos = self.template_tokens.get("eos_token")
        if eos is not None and eos not in self.special.ids:
            raise ValueError(f"{config_path}: eos_token {eos!r} is not one of the special tokens")
        self.eos_token_id = self.special.ids.get(eos)

    def __len__(self) -> int:
        return self.encoding.n_vocab

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in it are encoded as themselves. The format adds no BOS,
        so `add_special_tokens` changes nothing."""
        ids: list[int] = []
        for piece in split_long_runs(text):
            ids.extend(self.encoding.encode(piece, allowed_special="all"))
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; ids past the vocabulary (a model's padded rows) decode to nothing, as a Hugging Face
        tokenizer decodes ids it does not have (tiktoken raises on them)."""
        ids = [i for i in ids if 0 <= i < self.encoding.n_vocab]
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.special.skipped]
        return self.encoding.decode(ids, errors="replace")

    def token_bytes(self) -> list[bytes]:
        """Every id's bytes (a special token's are its text; an id the format does not define has none)."""
        out = []
        for token_id in range(self.encoding.n_vocab):
            try:
                out.append(self.encoding.decode_single_token_bytes(token_id))
            except KeyError:
                out.append(b"")
        return out

    def apply_chat_template(
        self,
        messages: list[dict],
        chat_template: str | None = None,
        tokenize: bool = False,
        add_generation_prompt: bool = False,
        tools: list[dict] | None = None,
        **kwargs,
    ) -> str:
        from transformers.utils.chat_template_utils import render_jinja_template

        template = chat_template or self.chat_template
        if not template:
            raise ValueError("this checkpoint has no chat template (tokenizer_config.json or chat_template.jinja)")
        if tokenize:
            raise ValueError("apply_chat_template renders text here; encode it with encode")
        rendered, _ = render_jinja_template(
            conversations=[messages],
            tools=_sorted_keys(tools),
            chat_template=template,
            add_generation_prompt=add_generation_prompt,
            **{**self.template_tokens, **kwargs},
        )
        return rendered[0]
