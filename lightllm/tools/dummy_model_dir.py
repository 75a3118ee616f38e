"""A weightless model folder at a released model's full size, for `--load_format dummy` (random weights).

    python -m lightllm.tools.dummy_model_dir --preset qwen3.5-35b-a3b --out /tmp/qwen3.5-35b-a3b-dummy \
        [--num_layers 40] [--dtype bfloat16]

The folder holds config.json (the released model's layout and widths, in its own key names), generation_config.json
and a small offline-trained byte-level BPE tokenizer with the family's special tokens and chat template; no
safetensors. The model's vocabulary keeps its released size (embeddings and LM head at full width); the tokenizer
covers only its first `TOKENIZER_VOCAB` ids, so text is for smoke tests only: benchmarks drive token ids. The
presets' widths are the released configs' (Qwen3-Next-80B-A3B, Qwen3.5-35B-A3B, Kimi-Linear-48B-A3B);
`--num_layers` cuts the depth (the layer pattern is kept).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from lightllm.tools.tiny_model.configs import generation_config, model_config
from lightllm.tools.tiny_model.sizes import DTYPES, TinySizes
from lightllm.tools.tiny_model.tokenizer import write_tokenizer

TOKENIZER_VOCAB = 4096
_QWEN_COMMON = dict(
    hidden_size=2048,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    conv_kernel_size=4,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
    full_attention_interval=4,
    num_mtp_layers=1,
)
# preset -> (architecture, sizes, max positions of the tokenizer)
PRESETS: dict[str, tuple[str, TinySizes, int]] = {
    "qwen3-next-80b-a3b": (
        "qwen3_next",
        TinySizes(
            **_QWEN_COMMON,
            num_layers=48,
            vocab_size=151936,
            intermediate_size=5120,
            num_experts=512,
            num_experts_per_tok=10,
        ),
        262_144,
    ),
    "qwen3.5-35b-a3b": (
        "qwen3_5_moe",
        TinySizes(**_QWEN_COMMON, num_layers=40, vocab_size=248320, num_experts=256, num_experts_per_tok=8),
        262_144,
    ),
    "kimi-linear-48b-a3b": (
        "kimi_linear",
        TinySizes(
            hidden_size=2304,
            num_layers=27,
            vocab_size=163840,
            num_attention_heads=32,
            num_key_value_heads=32,
            linear_num_key_heads=32,
            linear_num_value_heads=32,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            conv_kernel_size=4,
            intermediate_size=9216,
            moe_intermediate_size=1024,
            shared_expert_intermediate_size=1024,
            num_experts=256,
            num_experts_per_tok=8,
            full_attention_interval=4,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            first_k_dense_replace=1,
            num_mtp_layers=0,
        ),
        1_048_576,
    ),
}


def make_dummy_model_dir(
    preset: str, out_dir: str | Path, dtype: str = "bfloat16", num_layers: int | None = None
) -> Path:
    """Write the weightless folder of `preset` (see `PRESETS`) into `out_dir` (created if missing)."""
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {tuple(PRESETS)}, got {preset!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    arch, sizes, max_positions = PRESETS[preset]
    if num_layers is not None:
        sizes = dataclasses.replace(sizes, num_layers=num_layers)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(arch, TOKENIZER_VOCAB, max_positions, out)
    for name, obj in (
        ("config.json", model_config(arch, sizes, dtype, ids)),
        ("generation_config.json", generation_config(arch, ids)),
    ):
        (out / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m lightllm.tools.dummy_model_dir", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", required=True, choices=tuple(PRESETS))
    p.add_argument("--out", required=True, help="output directory (created if missing)")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    p.add_argument("--num_layers", type=int, default=None, help="cut the depth (default: the released depth)")
    args = p.parse_args(argv)
    print(make_dummy_model_dir(args.preset, args.out, args.dtype, args.num_layers))


if __name__ == "__main__":
    main()
