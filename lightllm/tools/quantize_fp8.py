"""Block-FP8 copies of a checkpoint in the format Qwen releases (and its dequantized twin).

    python -m lightllm.tools.quantize_fp8 --model_dir /path/to/bf16 --out /path/to/fp8 [--block 128 128]

Every 2-D `*.weight` of a linear layer becomes float8_e4m3fn with a `weight_scale_inv` grid beside it (one fp32
scale per block, partial blocks at the edges); the modules Qwen's releases keep unquantized (embeddings, lm_head,
MoE routers, the shared-expert gate, GDN's b / a projections) stay in their dtype and are listed in
`quantization_config.modules_to_not_convert`. Other files are copied unchanged.
`dequantize_checkpoint` writes the reverse (fp8 · scale in fp32, no quantization_config): the weights an FP8
model is compared against.
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from lightllm.kernels.fp8 import DEFAULT_BLOCK, dequantize_weight_blocks, quantize_weight_blocks
from lightllm.models.quant_config import KEPT_UNQUANTIZED, WEIGHT_SUFFIX, kept_unquantized, scale_name


def is_converted(name: str, shape: tuple[int, ...], not_converted: tuple[str, ...]) -> bool:
    """Whether `quantize_checkpoint` stores tensor `name` in FP8: a 2-D linear weight outside `not_converted`."""
    if not name.endswith(WEIGHT_SUFFIX) or len(shape) != 2 or ".visual." in name:
        return False
    return not kept_unquantized(name, not_converted)


def _rewrite(
    src: Path,
    out: Path,
    convert: Callable[[str, torch.Tensor, dict[str, torch.Tensor]], dict[str, torch.Tensor]],
    edit_config: Callable[[dict], None],
) -> Path:
    """Copy `src` to `out`, passing every tensor of every safetensors file through `convert` (name, tensor, the
    file's tensors -> tensors to write) and `config.json` through `edit_config`."""
    out.mkdir(parents=True, exist_ok=True)
    for path in sorted(src.iterdir()):
        if path.is_file() and path.suffix != ".safetensors" and path.name != "model.safetensors.index.json":
            shutil.copy2(path, out / path.name)
    weight_map = {}
    for path in sorted(src.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        written = {}
        for name, t in tensors.items():
            written.update(convert(name, t, tensors))
        save_file(written, out / path.name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(written, path.name))
    if (src / "model.safetensors.index.json").is_file():
        (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}, indent=2))
    config = json.loads((out / "config.json").read_text())
    edit_config(config)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def quantize_checkpoint(
    model_dir: str | Path,
    out: str | Path,
    block: tuple[int, int] = DEFAULT_BLOCK,
    not_converted: tuple[str, ...] = KEPT_UNQUANTIZED,
) -> Path:
    """Write the block-FP8 copy of the unquantized checkpoint `model_dir` into `out`; returns `out`."""
    skipped: set[str] = set()

    def convert(name: str, t: torch.Tensor, _) -> dict[str, torch.Tensor]:
        if not is_converted(name, tuple(t.shape), not_converted):
            if name.endswith(WEIGHT_SUFFIX) and t.dim() == 2:
                skipped.add(name[: -len(WEIGHT_SUFFIX)])
            return {name: t}
        q, scale = quantize_weight_blocks(t, block)
        return {name: q, scale_name(name): scale}

    def edit_config(config: dict) -> None:
        config["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(block),
            "modules_to_not_convert": sorted(skipped),
        }

    return _rewrite(Path(model_dir), Path(out), convert, edit_config)


def dequantize_checkpoint(model_dir: str | Path, out: str | Path) -> Path:
    """Write `out`: the block-FP8 checkpoint `model_dir` with every FP8 weight replaced by `fp8 · scale` in fp32
    (scales dropped, quantization_config removed); returns `out`."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    block = tuple(config["quantization_config"]["weight_block_size"])

    def convert(name: str, t: torch.Tensor, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if name.endswith("_scale_inv"):
            return {}
        if scale_name(name) in tensors:
            return {name: dequantize_weight_blocks(t, tensors[scale_name(name)], block)}
        return {name: t}

    return _rewrite(Path(model_dir), Path(out), convert, lambda c: c.pop("quantization_config"))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m lightllm.tools.quantize_fp8", description=__doc__.split("\n\n")[0])
    p.add_argument("--model_dir", required=True, help="an unquantized checkpoint folder")
    p.add_argument("--out", required=True, help="output folder (created if missing)")
    p.add_argument("--block", type=int, nargs=2, default=list(DEFAULT_BLOCK), help="weight block (rows, columns)")
    args = p.parse_args(argv)
    print(quantize_checkpoint(args.model_dir, args.out, tuple(args.block)))


if __name__ == "__main__":
    main()
