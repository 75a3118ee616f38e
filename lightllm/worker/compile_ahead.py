"""The engine's use of compile lists (`lightllm.kernels.compile_ahead`): which group of a list a runner's kernels
are, and the workers started for it before the weights load.

A group key names what decides a runner's kernel variants: the model's layout and shapes (not its depth or
vocabulary), the activation dtype, the tensor-parallel size and the weights' quantization. A start-up with a key the
list lacks starts nothing (the warm-up compiles as before); `lightllm.tools.record_compiles` records a key's group.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from pathlib import Path

import torch

from lightllm.kernels.compile_ahead.lists import entries_for_device
from lightllm.kernels.compile_ahead.pool import CompileAhead
from lightllm.kernels.tuned_tables import device_name
from lightllm.models.config import ModelConfig
from lightllm.models.quant_config import quant_method_of

logger = logging.getLogger(__name__)

# how long a start-up waits for its workers before warming up anyway (the warm-up then compiles what is missing)
WAIT_S = 120.0


def group_key(cfg: ModelConfig, dtype: torch.dtype, tp_size: int, quantization: str | None) -> str:
    """`arch/hHIDDEN/dtype/tpN/quant-<hash>`: readable, with a hash of every shape field that reaches a kernel."""
    shapes = dataclasses.asdict(cfg)
    for unused in ("vocab_size", "layer_types", "ffn_types", "eos_token_ids", "rms_norm_eps", "tie_word_embeddings"):
        shapes.pop(unused)
    shapes["layer_kinds"] = sorted(set(cfg.layer_types) | {f"ffn:{t}" for t in cfg.ffn_types})
    digest = hashlib.sha1(json.dumps(shapes, sort_keys=True, default=str).encode()).hexdigest()[:10]
    dtype_name = str(dtype).removeprefix("torch.")
    return f"{cfg.arch}/h{cfg.hidden_size}/{dtype_name}/tp{tp_size}/{quantization or 'none'}-{digest}"


def runner_group_key(config, cfg: ModelConfig) -> str:
    """The group key of a runner built from `config` (a `RunnerConfig`) for the checkpoint `cfg`."""
    raw = json.loads((Path(config.model_dir) / "config.json").read_text())
    quantization = config.quantization or quant_method_of(raw)
    return group_key(cfg, config.torch_dtype(cfg.torch_dtype), config.tp_size, quantization)


def start_compile_ahead(config, cfg: ModelConfig) -> CompileAhead | None:
    """Workers compiling the shipped list's group of this runner, on CUDA (None elsewhere, or with no list)."""
    device = torch.device(config.device)
    if device.type != "cuda":
        return None
    import triton
    from triton.runtime.driver import driver

    target = driver.active.get_current_target()
    name, key = device_name(device), runner_group_key(config, cfg)
    path, entries = entries_for_device(name, [target.backend, target.arch, target.warp_size], key)
    if not entries:
        logger.info(
            "no kernels to compile ahead (no list of %s or of its target has group %s for Triton %s)",
            name,
            key,
            triton.__version__,
        )
        return None
    if path.stem != name:
        logger.info(
            "compiling ahead from %s (recorded for the same target, %s %s)", path.name, target.backend, target.arch
        )
    return CompileAhead(entries, target)
