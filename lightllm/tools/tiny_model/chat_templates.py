"""Chat templates of the tiny checkpoints, written in each family's style (ChatML for Qwen, role tags for Kimi),
including how each family declares tools, writes an assistant's tool calls and hands back their results."""

from __future__ import annotations

_CONTENT = (
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- elif message['content'] is not none -%}"
    "{%- for part in message['content'] -%}{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
)
_ARGS_JSON = (
    "{%- if call['arguments'] is string -%}{{- call['arguments'] -}}{%- else -%}{{- call['arguments'] | tojson -}}"
    "{%- endif -%}"
)
# Qwen: tools declared in a system turn of their own, results returned in a user turn
_QWEN_TOOLS = (
    "{%- if tools -%}{{- '<|im_start|>system\\n# Tools\\n\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools><|im_end|>\\n' -}}{%- endif -%}"
)
_QWEN_TOOL_RESULT = (
    "{%- if message['role'] == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' -}}" + _CONTENT + "{{- '\\n</tool_response><|im_end|>\\n' -}}"
)
_QWEN3_JSON_CALLS = (
    "{%- for tc in message['tool_calls'] or [] -%}{%- set call = tc['function'] -%}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' -}}"
    + _ARGS_JSON
    + "{{- '}\\n</tool_call>' -}}{%- endfor -%}"
)
_QWEN3_XML_CALLS = (
    "{%- for tc in message['tool_calls'] or [] -%}{%- set call = tc['function'] -%}"
    "{{- '\\n<tool_call>\\n<function=' + call['name'] + '>\\n' -}}"
    "{%- if call['arguments'] is mapping -%}{%- for key, value in call['arguments'].items() -%}"
    "{{- '<parameter=' + key + '>\\n' -}}"
    "{%- if value is string -%}{{- value -}}{%- else -%}{{- value | tojson -}}{%- endif -%}"
    "{{- '\\n</parameter>\\n' -}}{%- endfor -%}{%- endif -%}"
    "{{- '</function>\\n</tool_call>' -}}{%- endfor -%}"
)


def _qwen(calls: str, generation_prompt: str) -> str:
    return (
        _QWEN_TOOLS + "{%- for message in messages -%}" + _QWEN_TOOL_RESULT + "{%- else -%}"
        "{{- '<|im_start|>' + message['role'] + '\\n' -}}" + _CONTENT + calls + "{{- '<|im_end|>\\n' -}}"
        "{%- endif -%}{%- endfor -%}" + generation_prompt
    )


# Qwen3-Next instruct: plain ChatML, no thinking block; calls as JSON in <tool_call> blocks.
QWEN3_NEXT = _qwen(_QWEN3_JSON_CALLS, "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")

# Qwen3.5: ChatML whose generation prompt opens a thinking block unless `enable_thinking=False`; calls in the
# function/parameter XML form.
QWEN3_5 = _qwen(
    _QWEN3_XML_CALLS,
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- else -%}{{- '<think>\\n' -}}{%- endif -%}"
    "{%- endif -%}",
)

# Kimi: `<|im_{role}|>{role}<|im_middle|>content<|im_end|>`, with a default system turn when none is given; tools
# declared in a `tool_declare` turn, calls in a section of special tokens, results in `tool` turns.
KIMI = (
    "{%- if tools -%}{{- '<|im_system|>tool_declare<|im_middle|>' + (tools | tojson) + '<|im_end|>' -}}{%- endif -%}"
    "{%- if messages | length == 0 or messages[0]['role'] != 'system' -%}"
    "{{- '<|im_system|>system<|im_middle|>You are a helpful assistant.<|im_end|>' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{- '<|im_system|>system<|im_middle|>' -}}"
    "{%- elif message['role'] == 'user' -%}{{- '<|im_user|>user<|im_middle|>' -}}"
    "{%- elif message['role'] == 'tool' -%}"
    "{{- '<|im_system|>tool<|im_middle|>## Return of ' + message['tool_call_id'] + '\\n' -}}"
    "{%- else -%}{{- '<|im_assistant|>' + message['role'] + '<|im_middle|>' -}}{%- endif -%}"
    + _CONTENT
    + "{%- if message['tool_calls'] -%}{{- '<|tool_calls_section_begin|>' -}}"
    "{%- for tc in message['tool_calls'] -%}{%- set call = tc['function'] -%}"
    "{{- '<|tool_call_begin|>' + tc['id'] + '<|tool_call_argument_begin|>' -}}"
    + _ARGS_JSON
    + "{{- '<|tool_call_end|>' -}}{%- endfor -%}{{- '<|tool_calls_section_end|>' -}}{%- endif -%}"
    "{{- '<|im_end|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_assistant|>assistant<|im_middle|>' -}}{%- endif -%}"
)

TEMPLATES = {"qwen3_next": QWEN3_NEXT, "qwen3_5": QWEN3_5, "qwen3_5_moe": QWEN3_5, "kimi_linear": KIMI}
