"""What the server needs to know about a checkpoint before loading it: read from its JSON files and the
safetensors headers only (no torch, no weights)."""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelInfo:
    model_dir: str
    architecture: str
    model_type: str
    vocab_size: int
    # None when the config does not say
    max_position_embeddings: int | None
    # dtype the weights were saved in ("bfloat16", "float32", ...), None when unknown
    torch_dtype: str | None
    # MTP modules present as `mtp.*` tensors in the weights
    num_mtp_layers: int
    # model end-of-sequence ids from config.json and generation_config.json
    eos_token_ids: tuple[int, ...]

    @property
    def has_mtp(self) -> bool:
        return self.num_mtp_layers > 0


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _as_ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]


def weight_names(model_dir: str) -> list[str]:
    """Tensor names of a safetensors checkpoint (single file or sharded with an index), from headers only."""
    index = _read_json(os.path.join(model_dir, "model.safetensors.index.json"))
    if index:
        return list(index.get("weight_map", {}))
    names: list[str] = []
    for file in sorted(os.listdir(model_dir)):
        if file.endswith(".safetensors"):
            with open(os.path.join(model_dir, file), "rb") as f:
                (header_len,) = struct.unpack("<Q", f.read(8))
                names += [k for k in json.loads(f.read(header_len)) if k != "__metadata__"]
    return names


def read_model_info(model_dir: str) -> ModelInfo:
    """Raise ValueError (with what is missing) when `model_dir` is not a usable checkpoint directory."""
    config_path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"--model_dir {model_dir}: no config.json there; point it at a Hugging Face checkpoint folder")
    config = _read_json(config_path)
    # multimodal wrappers (Qwen3.5) keep the language model's fields under text_config
    text = config.get("text_config") or config
    mtp_layers = {n.split(".")[1] for n in weight_names(model_dir) if n.startswith("mtp.layers.")}
    eos = _as_ids(text.get("eos_token_id", config.get("eos_token_id")))
    eos += _as_ids(_read_json(os.path.join(model_dir, "generation_config.json")).get("eos_token_id"))
    return ModelInfo(
        model_dir=model_dir,
        architecture=(config.get("architectures") or ["unknown"])[0],
        model_type=config.get("model_type", "unknown"),
        vocab_size=int(text["vocab_size"]),
        max_position_embeddings=text.get("max_position_embeddings"),
        torch_dtype=text.get("dtype") or text.get("torch_dtype") or config.get("torch_dtype"),
        num_mtp_layers=len(mtp_layers),
        eos_token_ids=tuple(dict.fromkeys(eos)),
    )
