"""Refuse a checkpoint folder the engine could not serve before anything is loaded, with one message naming the
file (and the field or tensor) and what was expected vs what was found.

Reads only JSON files and safetensors headers: the tensors the model would load, and their shapes, come from the
model itself (`HybridModel.checkpoint_shapes`, the same declaration `load_weights` checks against), so this check
and the loader cannot disagree about what a checkpoint must hold.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lightllm.models.quant_config import Fp8Config, UnsupportedQuantization, parse_quantization, scale_name

if TYPE_CHECKING:
    from lightllm.models.config import ModelConfig
    from lightllm.models.loader import Shapes, TensorHeader

INDEX_FILE = "model.safetensors.index.json"
# safetensors dtypes of 1-byte floats (F8_E4M3, F8_E5M2, F8_E8M0): values that mean nothing without their scales
FP8_PREFIX = "F8_"
# JSON side files that transformers parses when the tokenizer and generation defaults are loaded
SIDE_FILES = ("generation_config.json", "tokenizer_config.json", "special_tokens_map.json")
# without tokenizer.json a slow tokenizer needs one of these; with none of them transformers still builds a
# tokenizer, with an empty vocabulary, and every request decodes to empty text
SLOW_TOKENIZER_FILES = ("tokenizer.model", "tiktoken.model", "vocab.json", "vocab.txt", "spiece.model")
# tensors listed per kind of mismatch; the count says how many more there are
MAX_LISTED = 5


@dataclass(frozen=True)
class CheckedCheckpoint:
    """What the check read, so its callers need not read it again."""

    config: dict
    model_config: ModelConfig
    # raw checkpoint tensor name -> its header entry
    tensors: dict[str, TensorHeader]


def read_json(path: str) -> dict:
    """A JSON object file; ValueError naming the file when it is not valid JSON or not an object."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except json.JSONDecodeError as exc:
        # json's messages end in " at" before the position it appends; the position is spelled out here instead
        problem = exc.msg.removesuffix(" at")
        raise ValueError(
            f"{path}: expected valid JSON, found a syntax error at line {exc.lineno} column {exc.colno} ({problem})"
        ) from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: expected UTF-8 JSON, found undecodable bytes at offset {exc.start}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, found a JSON {type(value).__name__}")
    return value


def check_checkpoint(model_dir: str) -> CheckedCheckpoint:
    """Raise ValueError unless `model_dir` holds a readable config.json of a supported architecture, complete
    safetensors weights of exactly the tensors and shapes that config implies, and a tokenizer with a vocabulary."""
    config_path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"--model_dir {model_dir}: no config.json there; point it at a Hugging Face checkpoint folder")
    config = read_json(config_path)
    # before any weight file is opened: a quantization the engine cannot run is refused by name
    quant = check_quantization(config_path, config)
    for name in SIDE_FILES:
        if os.path.isfile(os.path.join(model_dir, name)):
            read_json(os.path.join(model_dir, name))
    tensors = read_weight_headers(model_dir)
    model_config = map_config(config_path, config, tensors)
    check_weight_shapes(model_dir, model_config, tensors, quant)
    check_tokenizer(model_dir)
    return CheckedCheckpoint(config, model_config, tensors)


def check_quantization(config_path: str, config: dict) -> Fp8Config | None:
    """The checkpoint's block-FP8 layout (None: unquantized); ValueError naming the file and the
    `quant_method` (or fp8 field) the engine cannot run, with what is supported."""
    try:
        return parse_quantization(config)
    except UnsupportedQuantization as exc:
        raise ValueError(f"{config_path}: {exc}") from None


def read_weight_headers(model_dir: str) -> dict[str, TensorHeader]:
    """Headers of every `*.safetensors` file (what the loader reads); a sharded checkpoint's index must not name a
    shard that is absent."""
    from lightllm.models.loader import read_safetensors_header

    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        present = ", ".join(sorted(os.listdir(model_dir))) or "nothing"
        raise ValueError(f"{model_dir}: expected *.safetensors weight files, found none (the folder holds {present})")
    index_path = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index_path):
        shards = sorted(set(read_json(index_path).get("weight_map", {}).values()))
        absent = [s for s in shards if s not in files]
        if absent:
            raise ValueError(
                f"{index_path}: expected the {len(shards)} shard files it names, found {len(shards) - len(absent)} "
                f"(absent: {', '.join(absent[:MAX_LISTED])})"
            )
    tensors: dict[str, TensorHeader] = {}
    for file in files:
        tensors.update(read_safetensors_header(os.path.join(model_dir, file)))
    return tensors


def map_config(config_path: str, config: dict, tensors: dict[str, TensorHeader]) -> ModelConfig:
    """The ModelConfig the engine will build; refusals (unsupported model_type, missing field) name the file."""
    # the model code imports torch (seconds): deferred so that importing the server's modules stays light
    from lightllm.models.registry import model_config_for_checkpoint

    try:
        return model_config_for_checkpoint(config, tensors)
    except ValueError as exc:
        raise ValueError(f"{config_path}: {exc}") from None


def check_weight_shapes(
    model_dir: str, cfg: ModelConfig, tensors: dict[str, TensorHeader], quant: Fp8Config | None = None
) -> None:
    """Compare the checkpoint's tensor names and header shapes with the ones the model built from `cfg` loads
    (with `quant`, also each block-FP8 weight's scale grid and its float8 dtype)."""
    from lightllm.models.hybrid import HybridModel
    from lightllm.models.loader import normalize_name, tensor_mismatch, with_block_scales

    # the module tree holds no weights before `load` (only the rotary frequencies, a few floats), so it is built
    # on the CPU: a meta-device build would first import torch's reference ops, ~2.5 s for nothing
    model = HybridModel(cfg, device="cpu")
    found, raw_name = {}, {}
    for raw, header in tensors.items():
        name = normalize_name(raw)
        if name is not None and not model.skips(name):
            found[name], raw_name[name] = header.shape, raw
    files = sorted({h.file.name for h in tensors.values()})

    def label(name: str) -> str:
        if name not in raw_name:
            return name
        # a sharded checkpoint: say which shard holds the tensor
        return raw_name[name] + (f" ({tensors[raw_name[name]].file.name})" if len(files) > 1 else "")

    expected = with_block_scales(model.checkpoint_shapes(set(found)), set(found), quant)
    dtypes = {n: tensors[raw_name[n]].dtype for n in expected if n in raw_name}
    lines = tensor_mismatch(expected, found, label, MAX_LISTED) + dtype_mismatch(expected, dtypes, quant, label)
    if lines:
        where = (
            os.path.join(model_dir, files[0]) if len(files) == 1 else f"{model_dir} ({len(files)} safetensors files)"
        )
        raise ValueError(
            f"{where}: the weights do not match config.json ({_describe(cfg)}); expected vs found:\n"
            + "\n".join(f"  {line}" for line in lines)
        )


def dtype_mismatch(
    expected: Shapes, dtypes: dict[str, str], quant: Fp8Config | None, label: Callable[[str], str]
) -> list[str]:
    """Lines naming the weights stored with a scale grid but not in float8_e4m3fn, and the float8 weights stored
    without one (their raw values are not the weights: every block is scaled by its `weight_scale_inv`)."""
    lines = []
    not_fp8 = [n for n in dtypes if scale_name(n) in expected and dtypes[n] != "F8_E4M3"]
    if not_fp8:
        lines.append(f"not float8_e4m3fn despite a {scale_name('')} " + _listed(not_fp8, dtypes, label))
    unscaled = [n for n in dtypes if scale_name(n) not in expected and dtypes[n].startswith(FP8_PREFIX)]
    if unscaled and (quant is None or not quant.in_checkpoint):
        lines.append("float8 but config.json has no fp8 quantization_config " + _listed(unscaled, dtypes, label))
    elif unscaled:
        lines.append(f"float8 without a {scale_name('')} beside it " + _listed(unscaled, dtypes, label))
    return lines


def _listed(names: list[str], dtypes: dict[str, str], label: Callable[[str], str]) -> str:
    shown = ", ".join(f"{label(n)} ({dtypes[n]})" for n in names[:MAX_LISTED])
    more = f" (+{len(names) - MAX_LISTED} more)" if len(names) > MAX_LISTED else ""
    return f"({len(names)}): {shown}{more}"


def _describe(cfg: ModelConfig) -> str:
    return (
        f"model_type {cfg.model_type}, hidden_size {cfg.hidden_size}, vocab_size {cfg.vocab_size}, "
        f"{cfg.num_layers} layers"
    )


def check_tokenizer(model_dir: str) -> None:
    """A tokenizer.json the `tokenizers` library can read, with a vocabulary; a readable `tiktoken.model` with its
    special tokens (the project's own loader, `tiktoken_tokenizer`); or a slow tokenizer's vocab file."""
    from lightllm.server.tiktoken_tokenizer import TiktokenTokenizer, is_tiktoken_folder

    if is_tiktoken_folder(model_dir):
        # built whole, so that what the server will load is what is checked
        TiktokenTokenizer(model_dir)
        return
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        if any(os.path.isfile(os.path.join(model_dir, f)) for f in SLOW_TOKENIZER_FILES):
            return
        raise ValueError(
            f"{path}: expected the tokenizer (or one of {', '.join(SLOW_TOKENIZER_FILES)}), found no such file; "
            "without it every request would decode to empty text"
        )
    from tokenizers import Tokenizer

    try:
        vocab_size = Tokenizer.from_file(path).get_vocab_size()
    # the Rust parser raises a bare Exception for every kind of malformed file
    except Exception as exc:
        raise ValueError(f"{path}: expected a readable tokenizer.json, found an unreadable one ({exc})") from None
    if vocab_size == 0:
        raise ValueError(f"{path}: expected a tokenizer with a vocabulary, found an empty one")
