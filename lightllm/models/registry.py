"""Pick the architecture of a checkpoint by `model_type` and turn its `config.json` into a ModelConfig."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable
from pathlib import Path

from lightllm.models.config import ModelConfig
from lightllm.models.kimi_linear.config import map_config as map_kimi_linear
from lightllm.models.loader import read_safetensors_header
from lightllm.models.quant_config import parse_quantization
from lightllm.models.qwen3_5.config import map_config as map_qwen3_5
from lightllm.models.qwen3_next.config import MTP_DEPTH_KEYS
from lightllm.models.qwen3_next.config import map_config as map_qwen3_next

CONFIG_MAPPERS: dict[str, Callable[[dict], ModelConfig]] = {
    "qwen3_next": map_qwen3_next,
    "qwen3_5": map_qwen3_5,
    "qwen3_5_text": map_qwen3_5,
    "qwen3_5_moe": map_qwen3_5,
    "qwen3_5_moe_text": map_qwen3_5,
    "kimi_linear": map_kimi_linear,
}
SUPPORTED_MODEL_TYPES = tuple(CONFIG_MAPPERS)


def text_config(raw: dict) -> dict:
    """The decoder's config: real Qwen3.5 checkpoints (the VLM layout) nest it under `text_config`.

    Fields set only at the top level (vocabulary ids, embedding tying) are inherited by the nested config."""
    nested = raw.get("text_config")
    if not nested:
        return raw
    merged = dict(nested)
    for key in ("tie_word_embeddings", "eos_token_id", "dtype", "torch_dtype"):
        if key in raw and key not in nested:
            merged[key] = raw[key]
    merged.setdefault("model_type", raw.get("model_type"))
    return merged


def model_config_from_dict(raw: dict) -> ModelConfig:
    """Map a parsed `config.json`; raises a ValueError naming the unknown `model_type` (with the supported ones),
    or the required field that is missing."""
    outer_type = raw.get("model_type")
    text = text_config(raw)
    model_type = text.get("model_type") or outer_type
    mapper = CONFIG_MAPPERS.get(model_type) or CONFIG_MAPPERS.get(outer_type)
    if mapper is None:
        raise ValueError(
            f"unsupported model_type {model_type!r} (outer {outer_type!r}); supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    where = " under text_config" if text is not raw else ""
    # refused before the architecture's fields are read: a quantized checkpoint often maps fine otherwise
    parse_quantization(raw)
    try:
        return mapper(text)
    except KeyError as exc:
        # the mappers index required fields directly: the missing key is the missing field
        raise ValueError(f"required field {exc.args[0]!r} is missing{where} (model_type {model_type!r})") from None
    except TypeError as exc:
        raise ValueError(f"a field{where} has the wrong type for model_type {model_type!r}: {exc}") from None


def model_config_for_checkpoint(raw: dict, tensor_names: Iterable[str]) -> ModelConfig:
    """`model_config_from_dict` plus the checkpoint's own say: Qwen checkpoints whose config does not declare an
    MTP depth (Qwen3-Next's) get one MTP layer when the checkpoint ships `mtp.*` tensors."""
    cfg = model_config_from_dict(raw)
    declared = any(k in text_config(raw) for k in MTP_DEPTH_KEYS)
    if cfg.arch != "kimi_linear" and not declared and any(n.startswith("mtp.") for n in tensor_names):
        cfg = dataclasses.replace(cfg, num_mtp_layers=1)
    return cfg


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Read `config.json` and the safetensors headers (names only) of a checkpoint folder."""
    with open(Path(model_dir) / "config.json") as f:
        raw = json.load(f)
    names = [n for path in sorted(Path(model_dir).glob("*.safetensors")) for n in read_safetensors_header(path)]
    return model_config_for_checkpoint(raw, names)
