"""The fused MoE entry points: routed experts (`fused_experts`) and the whole block (`fused_moe`).

Shapes are host values only (token count, top_k, expert count): no host sync, every buffer sized by the
worst-case padded layout, so the call runs inside a CUDA graph captured per batch bucket. The torch reference
and CPU path is `lightllm.models.layers.moe.run_experts`.
"""

from __future__ import annotations

import torch

from lightllm.kernels.fused_moe.align import align_pairs
from lightllm.kernels.fused_moe.combine import combine
from lightllm.kernels.fused_moe.configs import check_config, get_config
from lightllm.kernels.fused_moe.grouped_gemm import down_weighted, gate_up_swiglu


def fused_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    shared: torch.Tensor | None = None,
    shared_gate_logit: torch.Tensor | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """`sum_j weights[t, j] · expert_{ids[t, j]}(x[t])` with SwiGLU experts, as `[T, H]` in x's dtype.

    x: `[T, H]` (fp32, fp16 or bf16; last dim contiguous); gate_up: `[E, 2I, H]` (gate rows then up rows), down:
    `[E, H, I]`, both x's dtype and contiguous; weights: `[T, k]` (any float dtype; fp32 math); ids: `[T, k]`
    int32/int64 in 0..E-1 (a token may not pick an expert twice). `shared`: the shared expert's output `[T, H]`,
    added in the combine, scaled by `sigmoid(shared_gate_logit [T, 1])` when given. `config`: a launch configuration (see
    `configs.py`); None looks it up. The top-k rows of a token (then the shared row) are summed in fp32 in order
    j = 0..k-1, the same bits every run."""
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = gate_up.shape
    top_k = ids.shape[1]
    assert gate_up.shape == (num_experts, two_i, hidden) and down.shape == (num_experts, hidden, two_i // 2), (
        f"x {tuple(x.shape)} gate_up {tuple(gate_up.shape)} down {tuple(down.shape)}"
    )
    assert x.dtype == gate_up.dtype == down.dtype, f"dtypes x {x.dtype} gate_up {gate_up.dtype} down {down.dtype}"
    assert ids.shape == weights.shape == (num_tokens, top_k), f"ids {tuple(ids.shape)} weights {tuple(weights.shape)}"
    assert x.stride(-1) == 1 and gate_up.is_contiguous() and down.is_contiguous()
    out = torch.empty_like(x)
    if num_tokens == 0:
        return out
    if config is None:
        config = get_config(num_tokens, num_experts, two_i // 2, hidden, top_k, x.dtype, x.device)
    else:
        check_config(config)
    blocks = align_pairs(ids, num_experts, config["BLOCK_M"])
    num_pairs = num_tokens * top_k
    act = torch.empty(num_pairs, two_i // 2, dtype=x.dtype, device=x.device)
    gate_up_swiglu(x, gate_up, blocks, top_k, config["gate_up"], act)
    pair_out = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)
    flat_weights = weights.reshape(-1).to(torch.float32).contiguous()
    down_weighted(act, down, flat_weights, blocks, top_k, config["down"], pair_out)
    return combine(pair_out.view(num_tokens, top_k, hidden), out, shared, shared_gate_logit)
