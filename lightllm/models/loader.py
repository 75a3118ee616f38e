"""Checkpoint tensors -> model weights: safetensors reading, name normalisation, dtype, TP shards, key checks.

Modules pull their tensors by the real Hugging Face names (relative to the decoder root `model.`, or `lm_head.`,
`mtp.`) through a `WeightLoader`; the loader checks beforehand that the checkpoint holds exactly the tensors the
model declares, in the shapes it declares, and names every missing, unexpected and wrongly shaped one in one error.

Block-FP8 checkpoints (`quant_config`): a weight stored with a `weight_scale_inv` grid comes out of `get`
dequantized; a layer hands each projection it builds to `linear`, which quantizes it again over the same tiles
(an `Fp8Weight`) when every checkpoint tensor it came from was FP8, or when loading quantizes (`quantization="fp8"`).
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from lightllm.kernels.fp8 import FP8_DTYPE, block_scale_shape, check_block_scales, dequantize_weight_blocks
from lightllm.models.layers.quantized_linear import Fp8Weight, LinearWeight
from lightllm.models.quant_config import Fp8Config, kept_unquantized, parse_quantization, scale_name
from lightllm.models.tp import TPInfo

# checkpoint tensor name -> the full (unsharded) shape stored on disk
Shapes = dict[str, tuple[int, ...]]
# parameters that stay fp32 whatever the model dtype (gates and router biases feed fp32 math)
FP32_PARAM = re.compile(r"(A_log|dt_bias|e_score_correction_bias)$")


# bytes per element of each safetensors dtype: a tensor's data spans numel x this
DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2}
DTYPE_BYTES |= {"F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}
# the safetensors format caps its JSON header at 100 MB: a larger length field means the file is not safetensors
MAX_HEADER_BYTES = 100_000_000


@dataclass(frozen=True)
class TensorHeader:
    file: Path
    dtype: str
    shape: tuple[int, ...]


def read_safetensors_header(path: str | Path) -> dict[str, TensorHeader]:
    """Tensor name -> its header entry, from the file's JSON header only (no tensor data is read).

    Raises ValueError naming the file (and the tensor at fault) when the header is unreadable or the file is too
    short to hold every tensor's `data_offsets`: a truncated download fails here, not half-way through loading."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        length_field = f.read(8)
        if len(length_field) < 8:
            raise ValueError(f"{path}: truncated: expected at least an 8-byte header length, found {size} bytes")
        (header_len,) = struct.unpack("<Q", length_field)
        if header_len > MAX_HEADER_BYTES:
            raise ValueError(f"{path}: not a safetensors file (its header length field reads {header_len} bytes)")
        if 8 + header_len > size:
            raise ValueError(
                f"{path}: truncated: expected at least {8 + header_len} bytes for the header, found {size} bytes"
            )
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise ValueError(f"{path}: corrupt safetensors header (expected JSON: {exc})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: corrupt safetensors header (expected a JSON object, found {type(header).__name__})")
    return {
        name: _tensor_header(path, name, entry, 8 + header_len, size)
        for name, entry in header.items()
        if name != "__metadata__"
    }


def _tensor_header(path: Path, name: str, entry, data_start: int, size: int) -> TensorHeader:
    """One header entry, checked against the file: data_offsets count from the end of the header."""
    try:
        dtype, shape = str(entry["dtype"]), tuple(int(d) for d in entry["shape"])
        start, end = (int(x) for x in entry["data_offsets"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(
            f"{path}: corrupt header entry of tensor {name!r}: expected dtype, shape and data_offsets, found {entry!r}"
        ) from None
    width = DTYPE_BYTES.get(dtype)
    if width is not None and end - start != math.prod(shape) * width:
        raise ValueError(
            f"{path}: corrupt header entry of tensor {name!r}: {dtype} {list(shape)} needs "
            f"{math.prod(shape) * width} bytes, its data_offsets span {end - start}"
        )
    if data_start + end > size:
        raise ValueError(
            f"{path}: truncated: expected at least {data_start + end} bytes (the end of tensor {name!r}), "
            f"found {size} bytes"
        )
    return TensorHeader(path, dtype, shape)


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
        # canonical name -> the shape stored in the checkpoint
        self.shapes: Shapes = {}
        if isinstance(source, dict):
            items = [(k, None, tuple(t.shape)) for k, t in source.items()]
            self._tensors = dict(source)
        else:
            files = sorted(Path(source).glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors files in {source}")
            items = [(k, h.file, h.shape) for path in files for k, h in read_safetensors_header(path).items()]
        for raw, path, shape in items:
            name = normalize_name(raw)
            if name is None:
                continue
            self.raw_names[name] = raw
            self.shapes[name] = shape
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
        quant: Fp8Config | None = None,
    ):
        self.reader = reader
        self.dtype = dtype
        self.device = torch.device(device)
        self.tp = tp
        self.quant = quant
        self.consumed: set[str] = set()
        self._progress = progress

    def has(self, name: str) -> bool:
        return name in self.reader.raw_names

    def get(self, name: str, dim: int | None = None, num_heads: int | None = None, fp32: bool = False) -> torch.Tensor:
        """The tensor `name`; with `dim`, only this rank's shard of that dim (whole heads if `num_heads`);
        `fp32` keeps it in float32 whatever the model dtype. A block-FP8 tensor comes dequantized."""
        t = self._read(name)
        if dim is not None:
            t = self.tp.shard_heads(t, dim, num_heads) if num_heads else self.tp.shard(t, dim)
        return self.place(t, fp32=fp32 or bool(FP32_PARAM.search(name)))

    def get_linear(self, name: str, dim: int | None = None, num_heads: int | None = None) -> torch.Tensor:
        """A projection weight for `linear`: like `get`, but a block-FP8 tensor stays in fp32 after dequantizing,
        so that quantizing it again over the same tiles gives back the checkpoint's values and scales."""
        return self.get(name, dim, num_heads, fp32=self.is_scaled(name))

    def is_scaled(self, name: str) -> bool:
        """Whether the checkpoint stores `name` block-FP8 (with a scale grid beside it)."""
        return self.quant is not None and self.quant.in_checkpoint and scale_name(name) in self.reader.raw_names

    def quantizes(self, *names: str) -> bool:
        """Whether the projection fused from checkpoint tensors `names` is held in FP8: with an FP8 checkpoint
        when every part has a scale (a part the checkpoint left unquantized keeps the fused weight in the model
        dtype); with `--quantization fp8` unless a part is one of the modules FP8 releases keep unquantized."""
        if self.quant is None:
            return False
        if self.quant.in_checkpoint:
            return all(self.is_scaled(n) for n in names)
        return not any(kept_unquantized(n) for n in names)

    def linear(self, t: torch.Tensor, *names: str, quantize: bool | None = None) -> LinearWeight:
        """The projection `t` (fused from checkpoint tensors `names`, sharded) as the layer holds it: an
        `Fp8Weight` when `quantize` (default: `quantizes(*names)`), else a tensor in the model dtype."""
        if quantize if quantize is not None else self.quantizes(*names):
            return Fp8Weight.quantize(t.to(self.device), self.quant.block)
        return self.place(t)

    def _read(self, name: str) -> torch.Tensor:
        t = self.reader.get(name)
        self.consumed.add(name)
        if self._progress is not None:
            self._progress()
        if not self.is_scaled(name):
            check_not_fp8(name, t.dtype, self.quant)
            return t
        scale = self.reader.get(scale_name(name))
        self.consumed.add(scale_name(name))
        if t.dtype != FP8_DTYPE:
            raise ValueError(f"{name}: has a {scale_name(name)} so it must be float8_e4m3fn, found {t.dtype}")
        check_block_scales(tuple(t.shape), tuple(scale.shape), self.quant.block, name)
        # dequantized where the model lives: a GPU does it in a blink, and the fp8 copy is 1 byte per value
        return dequantize_weight_blocks(t.to(self.device), scale.to(self.device), self.quant.block)

    def place(self, t: torch.Tensor, fp32: bool = False) -> torch.Tensor:
        """Move a (possibly transformed) tensor to the model's device and dtype."""
        return t.to(device=self.device, dtype=torch.float32 if fp32 else self.dtype).contiguous()


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether `dtype` is one of torch's 1-byte floats (float8_e4m3fn, float8_e5m2, their fnuz and e8m0 kin)."""
    return dtype.is_floating_point and dtype.itemsize == 1


def check_not_fp8(name: str, dtype: torch.dtype, quant: Fp8Config | None) -> None:
    """Refuse an FP8 tensor read without a scale grid: its raw values are not the weights (each block is scaled
    by its `weight_scale_inv`), so loading them as they are gives a model that runs but says nothing sensible."""
    if not is_fp8(dtype):
        return
    if quant is None or not quant.in_checkpoint:
        raise ValueError(f"{name}: stored as {dtype} but config.json has no fp8 quantization_config to scale it")
    raise ValueError(f"{name}: stored as {dtype} without the {scale_name(name)} that scales it")


def tensor_mismatch(
    expected: Shapes, found: Shapes, label: Callable[[str], str] = str, limit: int | None = None
) -> list[str]:
    """Lines naming the missing, unexpected and wrongly shaped tensors of `found` against `expected` (the first
    `limit` of each kind, all when None; `label` spells a name); empty when they match."""
    missing = [n for n in expected if n not in found]
    unexpected = [n for n in found if n not in expected]
    wrong = [n for n in expected if n in found and tuple(found[n]) != tuple(expected[n])]
    lines = []
    for kind, names in (("missing", missing), ("unexpected", unexpected)):
        if names:
            shown = ", ".join(label(n) for n in names[:limit])
            more = f" (+{len(names) - limit} more)" if limit is not None and len(names) > limit else ""
            lines.append(f"{kind} ({len(names)}): {shown}{more}")
    if wrong:
        lines.append(f"wrong shape ({len(wrong)} of {len(expected)}):")
        for n in wrong[:limit]:
            lines.append(f"  {label(n)}: expected {list(expected[n])}, found {list(found[n])}")
        if limit is not None and len(wrong) > limit:
            lines.append(f"  (+{len(wrong) - limit} more)")
    return lines


def check_tensors(expected: Shapes, found: Shapes, context: str) -> None:
    """Raise one KeyError naming every missing, unexpected and wrongly shaped checkpoint tensor."""
    lines = tensor_mismatch(expected, found)
    if lines:
        raise KeyError("\n".join([f"checkpoint {context} does not match the model:"] + [f"  {x}" for x in lines]))


def load_weights(
    model,
    source: str | Path | dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    tp: TPInfo | None = None,
    show_progress: bool = True,
    quantization: str | Fp8Config | None = None,
) -> None:
    """Fill `model` from a checkpoint directory or an in-memory `{hf_name: tensor}` dict.

    `model` provides `skips(name)` (checkpoint tensors it deliberately ignores, e.g. `mtp.*` without MTP),
    `checkpoint_shapes(available)` (every tensor it needs, with its full shape) and `load(loader)`.
    A directory's `quantization_config` says whether it is block-FP8; `quantization="fp8"` quantizes an
    unquantized checkpoint's linear weights while loading; an `Fp8Config` describes a dict source."""
    quant = load_quantization(source, quantization)
    reader = CheckpointReader(source)
    found = {n: s for n, s in reader.shapes.items() if not model.skips(n)}
    available = set(found)
    expected = with_block_scales(model.checkpoint_shapes(available), available, quant)
    check_tensors(expected, found, str(source) if not isinstance(source, dict) else "<dict>")
    bar = tqdm(total=len(available), desc="loading weights", unit="tensor", disable=not show_progress)
    loader = WeightLoader(reader, dtype, device, tp or TPInfo(), progress=lambda: bar.update(1), quant=quant)
    try:
        model.load(loader)
    finally:
        bar.close()
        reader.close()
    assert loader.consumed == available, f"declared but not loaded: {sorted(available - loader.consumed)}"


def load_quantization(
    source: str | Path | dict[str, torch.Tensor], requested: str | Fp8Config | None
) -> Fp8Config | None:
    """A checkpoint directory's own block-FP8 layout wins (it loads as FP8 with or without the flag);
    `requested="fp8"` quantizes an unquantized one; an `Fp8Config` is taken as given."""
    if isinstance(requested, Fp8Config):
        return requested
    config_path = None if isinstance(source, dict) else Path(source) / "config.json"
    raw = json.loads(config_path.read_text()) if config_path is not None and config_path.is_file() else {}
    return parse_quantization(raw, requested)


def with_block_scales(expected: Shapes, available: set[str], quant: Fp8Config | None) -> Shapes:
    """`expected` plus the scale grid `[ceil(N / bn), ceil(K / bk)]` of every declared weight that a block-FP8
    checkpoint stores with a scale (the others keep their dtype and need none)."""
    if quant is None or not quant.in_checkpoint:
        return expected
    scales = {
        scale_name(n): block_scale_shape(shape, quant.block)
        for n, shape in expected.items()
        if len(shape) >= 2 and scale_name(n) in available
    }
    return expected | scales
