"""Checkpoint tensors -> model weights: safetensors reading, name normalisation, dtype, TP shards, key checks.

Modules pull their tensors by the real Hugging Face names (relative to the decoder root `model.`, or `lm_head.`,
`mtp.`) through a `WeightLoader`; the loader checks beforehand that the checkpoint holds exactly the keys the
model declares and names every missing and every unexpected key in one error.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from lightllm.models.tp import TPInfo

# parameters that stay fp32 whatever the model dtype (gates and router biases feed fp32 math)
FP32_PARAM = re.compile(r"(A_log|dt_bias|e_score_correction_bias)$")


def normalize_name(name: str) -> str | None:
    """The canonical name of a checkpoint key, or None for tensors the server never uses.

    Qwen3.5's VLM layout keeps the decoder under `model.language_model.` and the vision tower under
    `model.visual.`; Kimi's original checkpoints spell the dense layer's FFN `mlp.*` and the sparse ones
    `block_sparse_moe.*`, while transformers writes `block_sparse_moe.*` for both: everything becomes `mlp.`."""
    if name.startswith(("model.visual.", "visual.")):
        return None
    if name.startswith("model.language_model."):
        name = "model." + name[len("model.language_model.") :]
    return name.replace(".block_sparse_moe.", ".mlp.")


class CheckpointReader:
    """Lazy access to the tensors of a checkpoint directory (all `*.safetensors`) or of an in-memory dict."""

    def __init__(self, source: str | Path | dict[str, torch.Tensor]):
        self._files: dict[str, Path] = {}
        self._tensors: dict[str, torch.Tensor] = {}
        self._handles: dict[Path, object] = {}
        self.raw_names: dict[str, str] = {}
        if isinstance(source, dict):
            items = [(k, None) for k in source]
            self._tensors = dict(source)
        else:
            files = sorted(Path(source).glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors files in {source}")
            items = []
            for path in files:
                with safe_open(path, framework="pt") as f:
                    items += [(k, path) for k in f.keys()]
        for raw, path in items:
            name = normalize_name(raw)
            if name is None:
                continue
            self.raw_names[name] = raw
            if path is not None:
                self._files[name] = path

    def names(self) -> set[str]:
        return set(self.raw_names)

    def get(self, name: str) -> torch.Tensor:
        raw = self.raw_names[name]
        if raw in self._tensors:
            return self._tensors[raw]
        path = self._files[name]
        if path not in self._handles:
            self._handles[path] = safe_open(path, framework="pt")
        return self._handles[path].get_tensor(raw)

    def close(self) -> None:
        self._handles.clear()


class WeightLoader:
    """What a module sees while loading: named tensors converted to the model dtype/device, plus TP hooks."""

    def __init__(
        self,
        reader: CheckpointReader,
        dtype: torch.dtype,
        device: torch.device | str,
        tp: TPInfo,
        progress: Callable[[], None] | None = None,
    ):
        self.reader = reader
        self.dtype = dtype
        self.device = torch.device(device)
        self.tp = tp
        self.consumed: set[str] = set()
        self._progress = progress

    def has(self, name: str) -> bool:
        return name in self.reader.raw_names

    def get(self, name: str, dim: int | None = None, num_heads: int | None = None, fp32: bool = False) -> torch.Tensor:
        """The tensor `name`; with `dim`, only this rank's shard of that dim (whole heads if `num_heads`);
        `fp32` keeps it in float32 whatever the model dtype."""
        t = self.reader.get(name)
        self.consumed.add(name)
        if self._progress is not None:
            self._progress()
        if dim is not None:
            t = self.tp.shard_heads(t, dim, num_heads) if num_heads else self.tp.shard(t, dim)
        return self.place(t, fp32=fp32 or bool(FP32_PARAM.search(name)))

    def place(self, t: torch.Tensor, fp32: bool = False) -> torch.Tensor:
        """Move a (possibly transformed) tensor to the model's device and dtype."""
        return t.to(device=self.device, dtype=torch.float32 if fp32 else self.dtype).contiguous()


def check_keys(expected: Iterable[str], available: set[str], context: str) -> None:
    """Raise one KeyError naming every missing and every unexpected checkpoint key."""
    expected = set(expected)
    missing = sorted(expected - available)
    unexpected = sorted(available - expected)
    if missing or unexpected:
        lines = [f"checkpoint {context} does not match the model:"]
        if missing:
            lines.append(f"  missing ({len(missing)}): " + ", ".join(missing))
        if unexpected:
            lines.append(f"  unexpected ({len(unexpected)}): " + ", ".join(unexpected))
        raise KeyError("\n".join(lines))


def load_weights(
    model,
    source: str | Path | dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    tp: TPInfo | None = None,
    show_progress: bool = True,
) -> None:
    """Fill `model` from a checkpoint directory or an in-memory `{hf_name: tensor}` dict.

    `model` provides `skips(name)` (checkpoint tensors it deliberately ignores, e.g. `mtp.*` without MTP),
    `checkpoint_names(available)` (every key it needs) and `load(loader)`."""
    reader = CheckpointReader(source)
    available = {n for n in reader.names() if not model.skips(n)}
    check_keys(model.checkpoint_names(available), available, str(source) if not isinstance(source, dict) else "<dict>")
    bar = tqdm(total=len(available), desc="loading weights", unit="tensor", disable=not show_progress)
    loader = WeightLoader(reader, dtype, device, tp or TPInfo(), progress=lambda: bar.update(1))
    try:
        model.load(loader)
    finally:
        bar.close()
        reader.close()
    assert loader.consumed == available, f"declared but not loaded: {sorted(available - loader.consumed)}"
