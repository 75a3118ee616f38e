"""Chat templates of the tiny checkpoints, written in each family's style (ChatML for Qwen, role tags for Kimi)."""

from __future__ import annotations

_CONTENT = (
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- elif message['content'] is not none -%}"
    "{%- for part in message['content'] -%}{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
)

# Qwen3-Next instruct: plain ChatML, no thinking block.
QWEN3_NEXT = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}" + _CONTENT + "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Qwen3.5: ChatML whose generation prompt opens a thinking block unless `enable_thinking=False`.
QWEN3_5 = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}" + _CONTENT + "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- else -%}{{- '<think>\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)

# Kimi: `<|im_{role}|>{role}<|im_middle|>content<|im_end|>`, with a default system turn when none is given.
KIMI = (
    "{%- if messages | length == 0 or messages[0]['role'] != 'system' -%}"
    "{{- '<|im_system|>system<|im_middle|>You are a helpful assistant.<|im_end|>' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{- '<|im_system|>system<|im_middle|>' -}}"
    "{%- elif message['role'] == 'user' -%}{{- '<|im_user|>user<|im_middle|>' -}}"
    "{%- else -%}{{- '<|im_assistant|>' + message['role'] + '<|im_middle|>' -}}{%- endif -%}"
    + _CONTENT
    + "{{- '<|im_end|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_assistant|>assistant<|im_middle|>' -}}{%- endif -%}"
)

TEMPLATES = {"qwen3_next": QWEN3_NEXT, "qwen3_5": QWEN3_5, "qwen3_5_moe": QWEN3_5, "kimi_linear": KIMI}
