"""A checkpoint's `quantization_config` -> what the loader does with it; every method the engine cannot run is
refused by name before any weight is read.

Supported: block-wise FP8 as Qwen and DeepSeek release it (`quant_method: fp8`, `fmt: e4m3`, `weight_block_size:
[128, 128]`, `activation_scheme: dynamic`, a `weight_scale_inv` tensor beside each quantized weight; modules the
checkpoint leaves without a scale keep their dtype). An unquantized checkpoint can be quantized to the same format
while it loads (`--quantization fp8`). Reads JSON values only: no torch import, so the server can refuse early.
"""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED = (
    "supported: quant_method fp8 with fmt e4m3, a weight_block_size such as [128, 128] and activation_scheme "
    "dynamic (block-wise FP8, weight_scale_inv tensors), or an unquantized checkpoint (python -m "
    "lightllm.tools.quantize_fp8 writes an FP8 copy of one)"
)
# what `--quantization` accepts
QUANTIZATION_CHOICES = ("fp8",)
# the suffix a block-FP8 checkpoint appends to a quantized weight's name for its scale grid
SCALE_SUFFIX = "_scale_inv"
# modules Qwen's FP8 releases keep in their dtype, matched against the end of a module's name: embeddings, the LM
# head, the MoE routers (Kimi-Linear's is `block_sparse_moe.gate`), the shared-expert gate, and GDN's b / a
# projections (Qwen3-Next's fused `in_proj_ba`, Qwen3.5's `in_proj_b` and `in_proj_a`), which set the recurrent
# state's write strength and decay. Quantizing at load (`--quantization fp8`) and the offline tool keep the same set.
KEPT_UNQUANTIZED = (
    "embed_tokens",
    "lm_head",
    "mlp.gate",
    "block_sparse_moe.gate",
    "shared_expert_gate",
    "linear_attn.in_proj_ba",
    "linear_attn.in_proj_b",
    "linear_attn.in_proj_a",
)
WEIGHT_SUFFIX = ".weight"


class UnsupportedQuantization(ValueError):
    """A quantization the engine cannot run; the message names it and what is supported."""


@dataclass(frozen=True)
class Fp8Config:
    """Block-FP8 linear weights: one fp32 scale per `block` = (rows, columns) tile of each weight.

    `in_checkpoint`: the checkpoint stores float8_e4m3fn weights with `<name>_scale_inv` scales (only the weights
    with a scale are FP8); otherwise every linear weight is quantized while it loads."""

    block: tuple[int, int] = (128, 128)
    in_checkpoint: bool = True


def kept_unquantized(weight_name: str, kept: tuple[str, ...] = KEPT_UNQUANTIZED) -> bool:
    """Whether the weight `weight_name` (`....<module>.weight`) belongs to a module in `kept`."""
    module = weight_name.removesuffix(WEIGHT_SUFFIX)
    return any(module == m or module.endswith("." + m) for m in kept)


def scale_name(weight_name: str) -> str:
    """`model.layers.0.mlp.down_proj.weight` -> `model.layers.0.mlp.down_proj.weight_scale_inv`."""
    return weight_name + SCALE_SUFFIX


def quant_method_of(raw: dict) -> str | None:
    """The `quant_method` of a config's `quantization_config` (top level, or under `text_config`), None without
    one. bitsandbytes configs written before transformers named the method carry only `load_in_4bit/8bit`."""
    qc = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config")
    if not qc:
        return None
    if not isinstance(qc, dict):
        raise UnsupportedQuantization(f"quantization_config must be a JSON object, found {qc!r}; {SUPPORTED}")
    method = qc.get("quant_method")
    if method is None and (qc.get("load_in_4bit") or qc.get("load_in_8bit")):
        return "bitsandbytes"
    return str(method) if method is not None else "<none>"


def parse_quantization(raw: dict, requested: str | None = None) -> Fp8Config | None:
    """The quantization to load `raw` (a parsed config.json) with, given `--quantization` (`requested`).

    Raises UnsupportedQuantization naming the method (or the fp8 field) that cannot be served."""
    if requested is not None and requested not in QUANTIZATION_CHOICES:
        raise UnsupportedQuantization(
            f"--quantization {requested!r} is not supported; choose one of {', '.join(QUANTIZATION_CHOICES)}"
        )
    method = quant_method_of(raw)
    if method is None:
        return Fp8Config(in_checkpoint=False) if requested == "fp8" else None
    if method != "fp8":
        raise UnsupportedQuantization(f"quantization_config.quant_method {method!r} is not supported; {SUPPORTED}")
    qc = raw.get("quantization_config") or raw["text_config"]["quantization_config"]
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise UnsupportedQuantization(f"quantization_config fp8 with fmt {fmt!r} is not supported; {SUPPORTED}")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise UnsupportedQuantization(
            f"quantization_config fp8 with activation_scheme {scheme!r} (per-tensor input scales) is not "
            f"supported; {SUPPORTED}"
        )
    block = qc.get("weight_block_size")
    if block is None:
        raise UnsupportedQuantization(
            f"quantization_config fp8 without weight_block_size (per-tensor weight scales) is not supported; {SUPPORTED}"
        )
    if not _valid_block(block):
        raise UnsupportedQuantization(
            f"quantization_config fp8 weight_block_size {block!r} is not supported: expected two powers of two "
            f">= 16, such as [128, 128]"
        )
    return Fp8Config(block=(int(block[0]), int(block[1])), in_checkpoint=True)


def _valid_block(block) -> bool:
    # the GEMM steps K one scale group at a time (a Triton tile: a power of two, >= 16 for the dot)
    return (
        isinstance(block, list | tuple)
        and len(block) == 2
        and all(isinstance(b, int) and b >= 16 and b & (b - 1) == 0 for b in block)
    )
