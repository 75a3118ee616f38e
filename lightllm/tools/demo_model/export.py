"""Write the trained demo model as a released-layout Qwen3.5 checkpoint (`model.language_model.*`, `lm_head`,
`mtp.*`, and the tiny vision tower the VLM layout carries, seeded random since no text request uses it)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from lightllm.tools.tiny_model.weights import checkpoint_layout, init_tensor

from .model import ARCH, DemoModel

# transformers' MtpModel names -> the checkpoint's mtp.* names (one MTP layer)
_MTP_SHARED = {"eh_proj": "fc", "enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden", "post_norm": "norm"}


def checkpoint_name(trained_name: str) -> str | None:
    """Checkpoint tensor name of a `DemoModel.state_dict()` key (None: a tied alias, saved under its owner)."""
    part, _, rest = trained_name.partition(".")
    if part == "lm":
        return "model.language_model." + rest[len("model.") :] if rest.startswith("model.") else rest
    if rest.startswith(("embed_tokens.", "shared_head.")):
        return None
    layer, _, tail = rest.removeprefix("layers.0.").partition(".")
    if layer == "mtp_block":
        return "mtp.layers.0." + tail
    return f"mtp.{_MTP_SHARED[layer]}.{tail}"


def write_checkpoint_weights(model: DemoModel, out_dir: Path, dtype: torch.dtype, seed: int) -> int:
    """`out_dir/model.safetensors` for the config.json already in `out_dir`; returns its size in bytes."""
    layout = checkpoint_layout(ARCH, out_dir, num_mtp_layers=1)
    trained = {}
    for name, tensor in model.state_dict().items():
        target = checkpoint_name(name)
        if target is not None:
            trained[target] = tensor.detach().float().cpu()
    missing = sorted(n for n in layout if n not in trained and ".visual." not in n)
    extra = sorted(set(trained) - set(layout))
    if missing or extra:
        raise AssertionError(f"checkpoint names: missing {missing[:5]}, unexpected {extra[:5]}")
    tensors = {}
    for name, shape in sorted(layout.items()):
        value = trained[name] if name in trained else init_tensor(ARCH, name, shape, seed)
        if tuple(value.shape) != shape:
            raise AssertionError(f"{name}: trained shape {tuple(value.shape)} != checkpoint shape {shape}")
        tensors[name] = value.to(dtype).contiguous()
    path = out_dir / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    path.chmod(0o644)
    return path.stat().st_size
