"""The checkpoint's tokenizer and chat template, as used by the HTTP process and the offline `LLM`."""

from __future__ import annotations

from lightllm.server.model_info import ModelInfo


class Tokenizer:
    """Wraps the Hugging Face tokenizer of a checkpoint folder.

    The chat template comes from `tokenizer_config.json` or `chat_template.jinja`, whichever the checkpoint has
    (transformers reads both), and is rendered with jinja2 by `apply_chat_template`.
    """

    def __init__(self, info: ModelInfo):
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(info.model_dir)
        eos = list(info.eos_token_ids)
        if self.hf.eos_token_id is not None:
            eos.append(self.hf.eos_token_id)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos))
        self.vocab_size = len(self.hf)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.hf.chat_template)

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text))

    def render_chat(self, messages: list[dict], **template_kwargs) -> str:
        """Prompt text for a conversation, ending with the assistant's turn opened."""
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **template_kwargs)

    def encode_chat(self, messages: list[dict], **template_kwargs) -> list[int]:
        # the template already writes any BOS/special markers, so the tokenizer must not add its own
        return list(self.hf.encode(self.render_chat(messages, **template_kwargs), add_special_tokens=False))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        return self.hf.decode([token_id], skip_special_tokens=False)
