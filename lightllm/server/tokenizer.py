"""The checkpoint's tokenizer and chat template, as used by the HTTP process and the offline `LLM`."""

from __future__ import annotations

import re

from lightllm.server.model_info import ModelInfo
from lightllm.server.tiktoken_tokenizer import TiktokenTokenizer, is_tiktoken_folder

# NFC may merge up to three code points into one (Hangul jamo), so text can shrink by that much before it is split
NORMALIZATION_SHRINK = 3
_SP_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, inverted: each of the 256 bytes is written as one printable character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def import_tokenizer_library() -> None:
    """Import what `checkpoint_tokenizer` loads Hugging Face tokenizers with (seconds: transformers imports torch),
    ahead of knowing the checkpoint."""
    from transformers import AutoTokenizer  # noqa: F401


def checkpoint_tokenizer(model_dir: str):
    """The folder's Hugging Face tokenizer, or the project's `TiktokenTokenizer` for Kimi's format."""
    if is_tiktoken_folder(model_dir):
        return TiktokenTokenizer(model_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def eos_token_ids(info: ModelInfo, tokenizer_eos_id: int | None) -> tuple[int, ...]:
    """The ids that end a sequence: the checkpoint configs' and the tokenizer's own (None: it has none), in that
    order."""
    eos = list(info.eos_token_ids)
    if tokenizer_eos_id is not None:
        eos.append(tokenizer_eos_id)
    return tuple(dict.fromkeys(eos))


def direct_decoder(hf):
    """The Rust tokenizer behind `hf` when its decode is transformers' decode without the Python around it (no
    space clean-up), else None. Streaming decodes twice per token; the direct call costs a quarter as much."""
    backend = getattr(hf, "backend_tokenizer", None)
    return None if backend is None or getattr(hf, "clean_up_tokenization_spaces", True) else backend


def opening_problem(add_generation_prompt: bool, continue_final_message: bool, last_role: str) -> str | None:
    """Why a conversation whose last message has `last_role` cannot be rendered with vLLM's two switches (the
    assistant's turn opened after it, or its final message continued), else None."""
    if not continue_final_message:
        return None
    if add_generation_prompt:
        return "continue_final_message: set add_generation_prompt to false with it"
    if last_role != "assistant":
        return "continue_final_message: the last message must be the assistant's (the one to continue)"
    return None


class Tokenizer:
    """Wraps the tokenizer of a checkpoint folder: its Hugging Face tokenizer, or for a folder with
    `tiktoken.model` and no `tokenizer.json` (Kimi's format) the project's `TiktokenTokenizer`, which takes the
    same calls.

    The chat template comes from `tokenizer_config.json` or `chat_template.jinja`, whichever the checkpoint has
    (transformers reads both), unless `--chat_template` replaces it (`ModelInfo.chat_template`), and is rendered
    with jinja2 by `apply_chat_template`.
    """

    def __init__(self, info: ModelInfo):
        self.hf = checkpoint_tokenizer(info.model_dir)
        if info.chat_template is not None:
            self.hf.chat_template = info.chat_template
        self.eos_token_ids = eos_token_ids(info, self.hf.eos_token_id)
        self.vocab_size = len(self.hf)
        if isinstance(self.hf, TiktokenTokenizer):
            self._bytes = self.hf.token_bytes()
            # texts the tokenizer reads as one token wherever they occur: a grammar names them as tokens
            self.whole_tokens: dict[str, int] = dict(self.hf.special.ids)
        else:
            decoder = getattr(getattr(self.hf, "backend_tokenizer", None), "decoder", None)
            self._byte_decoder = _byte_level_decoder() if type(decoder).__name__ == "ByteLevel" else None
            self._added = {i: t.content for i, t in self.hf.added_tokens_decoder.items()}
            self.whole_tokens = {text: i for i, text in self._added.items()}
            pieces = self.hf.convert_ids_to_tokens(list(range(self.vocab_size)))
            self._bytes = [self._raw_bytes(i, piece) for i, piece in enumerate(pieces)]
        # no token spans more bytes than this, and a character is at least one byte
        self.max_token_bytes = max((len(b) for b in self._bytes), default=1) or 1
        self._fast_decode = direct_decoder(self.hf)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.hf.chat_template)

    def max_chars(self, max_tokens: int) -> int:
        """A text longer than this cannot fit in `max_tokens` tokens (checked before spending time tokenizing)."""
        return max_tokens * self.max_token_bytes * NORMALIZATION_SHRINK

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text))

    def render_chat(
        self,
        messages: list[dict],
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **template_kwargs,
    ) -> str:
        """Prompt text for a conversation, by default ending with the assistant's turn opened;
        `continue_final_message` leaves the final (assistant) message open instead."""
        return self.hf.apply_chat_template(
            messages,
            chat_template=chat_template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **template_kwargs,
        )

    def history_len(
        self, messages: list[dict], prompt_ids: list[int], chat_template: str | None = None, **template_kwargs
    ) -> int:
        """Tokens of `prompt_ids` (the rendered conversation, assistant turn opened) that spell the conversation
        alone, without the opened turn; 0 when that is not a token prefix of the prompt. The next turn repeats
        these tokens, while templates often render a past assistant turn unlike the opened one (a reasoning
        block is dropped), so this is where a prefix-cache checkpoint pays."""
        history = self.hf.apply_chat_template(
            messages, chat_template=chat_template, tokenize=False, add_generation_prompt=False, **template_kwargs
        )
        ids = self.encode_rendered(history)
        return len(ids) if len(ids) < len(prompt_ids) and prompt_ids[: len(ids)] == ids else 0

    def encode_chat(self, messages: list[dict], **template_kwargs) -> list[int]:
        return self.encode_rendered(self.render_chat(messages, **template_kwargs))

    def encode_rendered(self, prompt: str) -> list[int]:
        # the template already writes any BOS/special markers, so the tokenizer must not add its own
        return list(self.hf.encode(prompt, add_special_tokens=False))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._fast_decode is not None:
            return self._fast_decode.decode(ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes a token stands for; a token may hold part of a multi-byte UTF-8 character."""
        return self._bytes[token_id] if 0 <= token_id < len(self._bytes) else b""

    def token_text(self, token_id: int) -> str:
        """The token as text, or `bytes:\\xNN...` (OpenAI's form) when its bytes are not whole UTF-8 characters, so
        distinct fragment tokens never share a text."""
        raw = self.token_bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def _raw_bytes(self, token_id: int, piece: str | None) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode("utf-8")
        if piece is None:
            return b""
        if self._byte_decoder is not None and all(c in self._byte_decoder for c in piece):
            return bytes(self._byte_decoder[c] for c in piece)
        # sentencepiece: byte-fallback pieces are <0xNN>, a word boundary is "▁"
        match = _SP_BYTE.fullmatch(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        return piece.replace("▁", " ").encode("utf-8")
