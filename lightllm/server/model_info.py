"""What the server needs to know about a checkpoint before loading it: read from its JSON files and the
safetensors headers only (no weights), after `checkpoint_check` has refused anything the engine could not serve."""

from __future__ import annotations

import os
from dataclasses import dataclass

from lightllm.server.checkpoint_check import (
    CheckedCheckpoint,
    check_checkpoint,
    check_quantization,
    check_tokenizer,
    map_config,
    read_json,
)

LOAD_FORMATS = ("auto", "dummy")


@dataclass(frozen=True)
class ModelInfo:
    model_dir: str
    architecture: str
    model_type: str
    vocab_size: int
    # the context the model reaches (past the config's field when its rope is scaled); None when it does not say
    max_position_embeddings: int | None
    # dtype the weights were saved in ("bfloat16", "float32", ...), None when unknown
    torch_dtype: str | None
    # MTP modules present as `mtp.*` tensors in the weights
    num_mtp_layers: int
    # model end-of-sequence ids from config.json and generation_config.json
    eos_token_ids: tuple[int, ...]
    # (field, value) the requests' sampling defaults to, from the generation config `--generation_config` names
    # (`lightllm.server.sampling_defaults`); set once the flags are read
    sampling_defaults: tuple[tuple[str, float | int], ...] = ()
    # the chat template `--chat_template` puts in place of the checkpoint's (None: the checkpoint's own)
    chat_template: str | None = None

    @property
    def has_mtp(self) -> bool:
        return self.num_mtp_layers > 0


def _as_ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]


def check_config_only(model_dir: str) -> CheckedCheckpoint:
    """`--load_format dummy`: config.json (and its quantization) and the tokenizer are checked as for a real
    checkpoint; no weight file is read, and the folder need hold none."""
    config_path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"--model_dir {model_dir}: no config.json there; point it at a Hugging Face checkpoint folder")
    config = read_json(config_path)
    check_quantization(config_path, config)
    model_config = map_config(config_path, config, {})
    check_tokenizer(model_dir)
    return CheckedCheckpoint(config, model_config, {})


def read_model_info(model_dir: str, load_format: str = "auto") -> ModelInfo:
    """Raise ValueError (naming the file, and what was expected vs found) when `model_dir` is not a checkpoint the
    engine can serve; see `checkpoint_check.check_checkpoint`. With `load_format="dummy"` the weights are drawn
    at random from config.json, so only config.json and the tokenizer are checked (the MTP depth then comes from
    the config alone)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"--load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    checked = check_config_only(model_dir) if load_format == "dummy" else check_checkpoint(model_dir)
    # the check already imported the model code (for the config mappers); importing it here would make this module
    # heavy for the HTTP process's importers
    from lightllm.models.config import scaled_max_positions

    config = checked.config
    # multimodal wrappers (Qwen3.5) keep the language model's fields under text_config
    text = config.get("text_config") or config
    mtp_layers = {n.split(".")[1] for n in checked.tensors if n.startswith("mtp.layers.")}
    if load_format == "dummy":
        mtp_layers = set(range(checked.model_config.num_mtp_layers))
    eos = _as_ids(text.get("eos_token_id", config.get("eos_token_id")))
    generation_path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(generation_path):
        eos += _as_ids(read_json(generation_path).get("eos_token_id"))
    return ModelInfo(
        model_dir=model_dir,
        architecture=(config.get("architectures") or ["unknown"])[0],
        model_type=config.get("model_type", "unknown"),
        vocab_size=int(text["vocab_size"]),
        max_position_embeddings=scaled_max_positions(
            text.get("max_position_embeddings"), checked.model_config.attention.rope_scaling
        ),
        torch_dtype=text.get("dtype") or text.get("torch_dtype") or config.get("torch_dtype"),
        num_mtp_layers=len(mtp_layers),
        eos_token_ids=tuple(dict.fromkeys(eos)),
    )
