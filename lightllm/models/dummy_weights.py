"""Random weights from `config.json` alone (`--load_format dummy`): serve and benchmark a model without its files.

`DummyCheckpoint` stands in for a `CheckpointReader`: it declares exactly the tensors the model asks for
(`checkpoint_shapes`, in the stacked expert layout: one draw per layer's experts, no per-expert copies) and draws each one when the model loads it, on the target device, from a
generator seeded by the tensor's name and the seed, so two loads on the same kind of device give the same bits and
tensor parallel ranks draw the same full tensor before taking their shard.

Scales keep activations finite through any depth: matrices uniform with the variance of normal(0, 1/sqrt(fan_in))
(Kaiming-uniform, as `nn.Linear` initialises; uniform draws cost half of normal ones on a CPU) so every projection
keeps unit variance, the projections that write into the residual stream (attention / linear-attention / MLP output)
further scaled by 1/sqrt(2 * num_layers) so the residual grows no more than ~sqrt(2) over the whole stack;
embeddings with unit variance; RMSNorm gains at 1 (weight 0 for Qwen's zero-centred norms); biases 0; GDN / KDA decay
parameters drawn as their reference initialisations do (A = uniform(1, 16), dt log-uniform in [1e-3, 0.1] stored
as softplus^-1(dt)).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import zlib

import torch

from lightllm.models.config import ModelConfig
from lightllm.models.loader import Shapes, WeightLoader, load_quantization
from lightllm.models.quant_config import parse_quantization
from lightllm.models.tp import TPInfo

logger = logging.getLogger(__name__)

# Qwen's q/k norms are always zero-centred; decoder, final and MTP norms follow the config's convention; the
# remaining norms (GDN/KDA output norms, MLA latent norm) scale by w
ALWAYS_ZERO_CENTERED = re.compile(r"\.(q_norm|k_norm)\.weight$")
MODEL_NORM = re.compile(r"(input_layernorm|post_attention_layernorm|^model\.norm|^mtp\.norm|pre_fc_norm_\w+)\.weight$")
# projections whose output is added to the residual stream
RESIDUAL_OUT = re.compile(r"(\.o_proj|\.out_proj|\.down_proj|\.w2)(\.weight)?$")
# the first expert's gate projection names a MoE block; its stacked layout is declared by `experts.gate_up_proj`
FIRST_EXPERT = re.compile(r"experts\.0\.(gate_proj|w1)\.weight$")
DT_MIN, DT_MAX = 1e-3, 1e-1
A_MIN, A_MAX = 1.0, 16.0


class DummyCheckpoint:
    """A `CheckpointReader` look-alike over `shapes`, drawing each tensor (fp32, on `device`) when it is read."""

    def __init__(self, shapes: Shapes, cfg: ModelConfig, device: torch.device | str, seed: int = 0):
        self.shapes: Shapes = dict(shapes)
        self.raw_names = {n: n for n in shapes}
        self.cfg = cfg
        self.device = torch.device(device)
        self.seed = seed

    def names(self) -> set[str]:
        return set(self.raw_names)

    def close(self) -> None:
        pass

    def get(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        # one 32-bit seed per (seed, name): the CPU generator (mt19937) keeps only a seed's low 32 bits
        gen = torch.Generator(device=self.device).manual_seed(zlib.crc32(f"{self.seed}:{name}".encode()))
        return draw(name, shape, self.cfg, gen, self.device)


def draw(name: str, shape: tuple[int, ...], cfg: ModelConfig, gen: torch.Generator, device) -> torch.Tensor:
    """One random tensor for checkpoint tensor `name` (see the module docstring for the scales)."""

    def uniform(lo: float, hi: float) -> torch.Tensor:
        return torch.rand(shape, generator=gen, device=device) * (hi - lo) + lo

    if name.endswith("A_log"):
        return uniform(A_MIN, A_MAX).log()
    if name.endswith("dt_bias"):
        dt = uniform(math.log(DT_MIN), math.log(DT_MAX)).exp()
        return dt + torch.log(-torch.expm1(-dt))
    if len(shape) == 1:
        if not name.endswith("norm.weight") and "layernorm" not in name:
            return torch.zeros(shape, device=device)
        zero_centered = ALWAYS_ZERO_CENTERED.search(name) or (MODEL_NORM.search(name) and cfg.zero_centered_norm)
        return torch.full(shape, 0.0 if zero_centered else 1.0, device=device)
    if name.endswith("embed_tokens.weight"):
        return symmetric_uniform(shape, 1.0, gen, device)
    std = 1.0 / math.sqrt(math.prod(shape[1:]) if len(shape) != 3 or "experts" not in name else shape[-1])
    if RESIDUAL_OUT.search(name):
        std /= math.sqrt(2 * cfg.num_layers)
    return symmetric_uniform(shape, std, gen, device)


def symmetric_uniform(shape: tuple[int, ...], std: float, gen: torch.Generator, device) -> torch.Tensor:
    """uniform(-a, a) with standard deviation `std` (a = std * sqrt(3))."""
    bound = std * math.sqrt(3.0)
    return torch.rand(shape, generator=gen, device=device).mul_(2 * bound).sub_(bound)


def dummy_shapes(model) -> dict[str, tuple[int, ...]]:
    """Every tensor `model` loads, MoE experts in the stacked layout, less those it skips."""
    shapes = model.checkpoint_shapes(None)
    stacked = {FIRST_EXPERT.sub("experts.gate_up_proj", n) for n in shapes if FIRST_EXPERT.search(n)}
    if stacked:
        shapes = model.checkpoint_shapes(set(shapes) | stacked)
    return {n: s for n, s in shapes.items() if not model.skips(n)}


def load_dummy_weights(
    model,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    tp: TPInfo | None = None,
    seed: int = 0,
    model_dir: str | None = None,
    quantization: str | None = None,
) -> None:
    """Fill `model` (a `HybridModel`: `checkpoint_shapes`, `skips`, `load`) with random weights drawn from its
    config alone; logs that the weights are random. No weight file is read. A block-FP8 config (`model_dir`'s
    `quantization_config`) or `quantization="fp8"` quantizes each drawn weight as it loads, as an FP8 checkpoint
    would hold it."""
    shapes = dummy_shapes(model)
    logger.warning(
        "load_format dummy: the weights are RANDOM (seed %d, %d tensors drawn from config.json): outputs are "
        "meaningless; for benchmarks only",
        seed,
        len(shapes),
    )
    reader = DummyCheckpoint(shapes, model.cfg, device, seed)
    quant = (
        load_quantization(model_dir, quantization) if model_dir is not None else parse_quantization({}, quantization)
    )
    if quant is not None:
        # random draws have no scales: every FP8 layer quantizes its drawn weight
        quant = dataclasses.replace(quant, in_checkpoint=False)
    loader = WeightLoader(reader, dtype, device, tp or TPInfo(), quant=quant)
    model.load(loader)
    missing = set(shapes) - loader.consumed
    assert not missing, f"declared but not loaded: {sorted(missing)[:5]}"
