"""Compile every variant of the fused MoE kernels a model's MoE layers launch, on scratch tensors, at start-up.

The kernels' compile keys depend on the model (expert count and widths, top-k, router, dtype, shared expert) and,
for the two grouped GEMMs, on the launch configuration of the token count's batch bucket; nothing else varies with
the batch. Running one launch per distinct configuration up to the longest chunk covers every key a serving step
can meet, so no step compiles.
"""

from __future__ import annotations

import torch

from lightllm.kernels.fused_moe.configs import get_config
from lightllm.kernels.fused_moe.fused_moe import MAX_CHUNK_TOKENS, fused_experts
from lightllm.kernels.fused_moe.routing import sigmoid_topk, softmax_topk


def warmup_token_counts(
    max_tokens: int, num_experts: int, inter: int, hidden: int, top_k: int, dtype, device, fp8: bool = False
) -> list:
    """One token count per distinct launch configuration of 1 .. `max_tokens` (capped at the chunk size; `fp8`:
    block-FP8 experts)."""
    seen, counts = [], []
    n = 1
    while True:
        config = get_config(n, num_experts, inter, hidden, top_k, dtype, torch.device(device), fp8)
        if config not in seen:
            seen.append(config)
            counts.append(n)
        if n >= min(max_tokens, MAX_CHUNK_TOKENS):
            return counts
        n = min(2 * n, max_tokens, MAX_CHUNK_TOKENS)


def warmup_fused_moe(
    gate_up: torch.Tensor,
    down: torch.Tensor,
    top_k: int,
    max_tokens: int,
    scoring: str = "softmax",
    num_groups: int = 1,
    topk_groups: int = 1,
    shared: bool = False,
    shared_gate: bool = False,
    gate_beside_logits: bool = False,
    act_dtype: torch.dtype | None = None,
    gate_up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,
) -> int:
    """Route and run the experts `gate_up [E, 2I, H]`, `down [E, H, I]` (a layer's own weights: only read, so
    the warm-up allocates no expert-sized scratch) once per distinct configuration of 1 .. `max_tokens` tokens on
    scratch activations; `shared` / `shared_gate` as the layer combines, `gate_beside_logits` when the layer's one
    GEMM gives the router's logits and the gate logit as columns of one tensor (their strides are part of the
    kernels' compile keys). Block-FP8 experts come with their scales
    and `block` (as `fused_experts` takes them) and `act_dtype`, the activations' dtype. Returns the launch
    sequences run."""
    num_experts, hidden, inter = down.shape
    dtype, device = act_dtype or gate_up.dtype, gate_up.device
    fp8 = {} if gate_up_scale is None else {"gate_up_scale": gate_up_scale, "down_scale": down_scale, "block": block}
    counts = warmup_token_counts(
        max_tokens, num_experts, inter, hidden, top_k, dtype, device, gate_up_scale is not None
    )
    bias = torch.zeros(num_experts, device=device)
    for n in counts:
        x = torch.randn(n, hidden, device=device).to(dtype)
        # the router's logits and the gate logit: columns of one tensor where the layer's one GEMM gives both
        both = torch.randn(n, num_experts + 1, device=device)
        if scoring == "softmax":
            both = both.to(dtype)
        logits, gate = both[:, :-1], both[:, -1:]
        if not gate_beside_logits:
            logits, gate = logits.contiguous(), gate.contiguous()
        if scoring == "sigmoid":
            weights, ids = sigmoid_topk(logits, bias, top_k, True, 1.0, num_groups, topk_groups)
        else:
            weights, ids = softmax_topk(logits, top_k, True)
        shared_out = torch.randn(n, hidden, device=device).to(dtype) if shared else None
        gate = gate.to(dtype) if shared_gate else None
        fused_experts(x, gate_up, down, weights, ids, shared_out, gate, **fp8)
    return len(counts)
