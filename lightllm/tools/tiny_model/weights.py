"""Deterministic, well-conditioned random weights for tiny checkpoints, under the real checkpoint names.

The names and shapes come from transformers itself: a model built from the written config.json is saved once
(`save_pretrained` writes the released per-expert / grouped layouts), and the MTP names are harvested from a one-layer
full-attention copy re-rooted under `mtp.` (transformers drops `mtp.*` on save). Each tensor is then drawn from its own
generator seeded by (seed, name), so values do not depend on iteration order or library internals.
"""

from __future__ import annotations

import copy
import hashlib
import math
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

# Router logits get this much spread so top-k margins are clear (no near-ties between experts). Kimi routes on
# sigmoid scores, which saturate (and so tie) for large logits, hence its smaller spread.
_ROUTER_SCALE = {"kimi_linear": 1.5}
_DEFAULT_ROUTER_SCALE = 4.0
# Output logits spread: large enough that greedy decoding is not a near-uniform coin toss.
_LM_HEAD_SCALE = 3.0
# Residual-branch outputs are damped so the residual stream stays O(1) through the stack.
_OUT_PROJ_SCALE = 0.5
_OUT_PROJ_SUFFIXES = ("o_proj.weight", "out_proj.weight", "down_proj.weight", ".w2.weight")

_TEXT_CAUSAL_LM = {
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5": "Qwen3_5ForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
}


def _saved_layout(model) -> dict[str, tuple[int, ...]]:
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        layout = {}
        for path in sorted(Path(tmp).glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    layout[name] = tuple(f.get_slice(name).get_shape())
    return layout


def checkpoint_layout(arch: str, model_dir: Path, num_mtp_layers: int) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor names -> shapes for the config.json in `model_dir`, including the `mtp.*` tensors."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(model_dir))
    # Building models draws from the global RNG; keep the caller's RNG state untouched.
    with torch.random.fork_rng(devices=[]):
        model = getattr(transformers, config.architectures[0])(config)
        layout = _saved_layout(model)
        if arch == "kimi_linear":
            layout = _kimi_original_dense_names(layout)
        if arch in _TEXT_CAUSAL_LM and num_mtp_layers > 0:
            layout.update(_mtp_layout(arch, config.get_text_config(), num_mtp_layers))
    return layout


def _kimi_original_dense_names(layout: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    # transformers saves Kimi's dense layers under `block_sparse_moe.{gate,up,down}_proj`; the released checkpoint
    # names them `mlp.{gate,up,down}_proj` (transformers maps both back on load).
    out = {}
    for name, shape in layout.items():
        head, sep, tail = name.partition(".block_sparse_moe.")
        if sep and tail in ("gate_proj.weight", "up_proj.weight", "down_proj.weight"):
            name = f"{head}.mlp.{tail}"
        out[name] = shape
    return out


def _mtp_layout(arch: str, text_config, num_mtp_layers: int) -> dict[str, tuple[int, ...]]:
    import transformers

    cfg = copy.deepcopy(text_config)
    cfg.num_hidden_layers = num_mtp_layers
    cfg.layer_types = ["full_attention"] * num_mtp_layers
    aux = getattr(transformers, _TEXT_CAUSAL_LM[arch])(cfg)
    hidden = text_config.hidden_size
    layout = {
        "mtp.fc.weight": (hidden, 2 * hidden),
        "mtp.pre_fc_norm_embedding.weight": (hidden,),
        "mtp.pre_fc_norm_hidden.weight": (hidden,),
        "mtp.norm.weight": (hidden,),
    }
    for name, shape in _saved_layout(aux).items():
        if name.startswith("model.layers."):
            layout["mtp." + name[len("model.") :]] = shape
    return layout


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def _zero_centered_norm(arch: str, name: str) -> bool:
    # Qwen RMSNorms compute x_norm * (1 + w); the GDN gated norm and the vision tower use plain weights.
    return arch != "kimi_linear" and "visual" not in name and not name.endswith("linear_attn.norm.weight")


def init_tensor(arch: str, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """fp32 values of checkpoint tensor `name`; realistic for SSM gate parameters, scaled for clear margins."""
    g = _generator(seed, name)
    randn = lambda: torch.randn(shape, generator=g)
    uniform = lambda lo, hi: lo + (hi - lo) * torch.rand(shape, generator=g)
    if name.endswith("A_log"):
        # Decay rates A in [1, 16], as in Mamba/GDN initialisation.
        return torch.log(uniform(1.0, 16.0))
    if name.endswith("dt_bias"):
        # Time steps log-uniform in [1e-3, 1e-1]; stored as softplus^-1(dt).
        dt = torch.exp(uniform(math.log(1e-3), math.log(1e-1)))
        return dt + torch.log(-torch.expm1(-dt))
    if name.endswith("e_score_correction_bias"):
        return 0.1 * randn()
    if name.endswith(".bias"):
        return torch.zeros(shape)
    if len(shape) == 1 or "norm" in name.rsplit(".", 2)[-2]:
        return 0.1 * randn() if _zero_centered_norm(arch, name) else 1.0 + 0.1 * randn()
    fan_in = math.prod(shape[1:])
    std = 1.0 / math.sqrt(fan_in)
    if name.endswith("embed_tokens.weight"):
        std = 1.0
    elif name == "lm_head.weight":
        std *= _LM_HEAD_SCALE
    elif name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
        std *= _ROUTER_SCALE.get(arch, _DEFAULT_ROUTER_SCALE)
    elif name.endswith(_OUT_PROJ_SUFFIXES):
        std *= _OUT_PROJ_SCALE
    return std * randn()


def write_weights(arch: str, model_dir: Path, seed: int, dtype: str, num_mtp_layers: int) -> dict[str, tuple]:
    """Write `model_dir/model.safetensors` for the config.json already there; returns the layout written."""
    layout = checkpoint_layout(arch, model_dir, num_mtp_layers)
    torch_dtype = getattr(torch, dtype)
    tensors = {
        name: init_tensor(arch, name, shape, seed).to(torch_dtype).contiguous()
        for name, shape in sorted(layout.items())
    }
    path = model_dir / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    # safetensors creates the file private; the other checkpoint files are world-readable.
    path.chmod(0o644)
    return layout
