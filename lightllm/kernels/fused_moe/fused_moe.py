"""The fused MoE entry point `fused_experts`: the routed experts of one layer plus the combine with the shared expert.

Shapes are host values only (token count, top_k, expert count): no host sync, every buffer sized by the
worst-case padded layout, so the call runs inside a CUDA graph captured per batch bucket. The torch reference
and CPU path is `lightllm.models.layers.moe.run_experts`.
"""

from __future__ import annotations

import torch

from lightllm.kernels.fp8 import FP8_DTYPE, check_block_scales, quantize_activation_groups
from lightllm.kernels.fused_moe.align import align_pairs
from lightllm.kernels.fused_moe.combine import combine
from lightllm.kernels.fused_moe.configs import check_config, get_config
from lightllm.kernels.fused_moe.grouped_gemm import down_weighted, gate_up_swiglu

# tokens per launch sequence: a prefill chunk of the default size (8192) in one launch, whose ~256 rows per expert
# (top-8 of 256) take the tall prefill blocks and read each expert's weights once, while the fp32 per-pair outputs
# stay ~0.5-0.6 GB at the served widths
MAX_CHUNK_TOKENS = 8192


def fused_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    shared: torch.Tensor | None = None,
    shared_gate_logit: torch.Tensor | None = None,
    config: dict | None = None,
    gate_up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,
) -> torch.Tensor:
    """`sum_j weights[t, j] · expert_{ids[t, j]}(x[t])` with SwiGLU experts, as `[T, H]` in x's dtype.

    x: `[T, H]` (fp32, fp16 or bf16; last dim contiguous); gate_up: `[E, 2I, H]` (gate rows then up rows), down:
    `[E, H, I]`, both x's dtype and contiguous; weights: `[T, k]` (any float dtype; fp32 math); ids: `[T, k]`
    int32/int64 in 0..E-1 (a token may not pick an expert twice). `shared`: the shared expert's output `[T, H]`,
    added in the combine, scaled by `sigmoid(shared_gate_logit [T, 1])` when given. `config`: a launch configuration (see
    `configs.py`); None looks it up. The top-k rows of a token (then the shared row) are summed in fp32 in order
    j = 0..k-1, the same bits every run.

    Block-FP8 experts: `gate_up` and `down` float8_e4m3fn with `gate_up_scale [E, ceil(2I / bn), ceil(H / bk)]`,
    `down_scale [E, ceil(H / bn), ceil(I / bk)]` for `block = (bn, bk)`; x and the SwiGLU activations are
    quantized per row per `bk` channels (W8A8, fp32 accumulation), the output keeps x's dtype."""
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = gate_up.shape
    top_k = ids.shape[1]
    assert gate_up.shape == (num_experts, two_i, hidden) and down.shape == (num_experts, hidden, two_i // 2), (
        f"x {tuple(x.shape)} gate_up {tuple(gate_up.shape)} down {tuple(down.shape)}"
    )
    fp8 = gate_up_scale is not None
    if fp8:
        assert gate_up.dtype == down.dtype == FP8_DTYPE and down_scale is not None and block is not None
        check_block_scales(tuple(gate_up.shape), tuple(gate_up_scale.shape), block, "gate_up_scale")
        check_block_scales(tuple(down.shape), tuple(down_scale.shape), block, "down_scale")
    else:
        assert x.dtype == gate_up.dtype == down.dtype, f"dtypes x {x.dtype} gate_up {gate_up.dtype} down {down.dtype}"
    assert ids.shape == weights.shape == (num_tokens, top_k), f"ids {tuple(ids.shape)} weights {tuple(weights.shape)}"
    assert x.stride(-1) == 1 and gate_up.is_contiguous() and down.is_contiguous()
    out = torch.empty_like(x)
    if config is not None:
        check_config(config)
    # long prefills run in chunks: the per-pair buffers (fp32 [T * k, H]) stay bounded whatever the token count
    for start in range(0, num_tokens, MAX_CHUNK_TOKENS):
        rows = slice(start, min(start + MAX_CHUNK_TOKENS, num_tokens))
        _experts_chunk(
            x[rows],
            gate_up,
            down,
            weights[rows],
            ids[rows],
            None if shared is None else shared[rows],
            None if shared_gate_logit is None else shared_gate_logit[rows],
            config,
            (gate_up_scale, down_scale, block) if fp8 else None,
            out[rows],
        )
    return out


def _experts_chunk(x, gate_up, down, weights, ids, shared, shared_gate_logit, config, fp8, out) -> None:
    """`fused_experts` on at most MAX_CHUNK_TOKENS tokens, written into `out` (a row slice of the result);
    `fp8`: (gate_up_scale, down_scale, block) for block-FP8 experts, else None."""
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = gate_up.shape
    top_k = ids.shape[1]
    if config is None:
        config = get_config(num_tokens, num_experts, two_i // 2, hidden, top_k, x.dtype, x.device, fp8 is not None)
    blocks = align_pairs(ids, num_experts, config["BLOCK_M"])
    num_pairs = num_tokens * top_k
    act = torch.empty(num_pairs, two_i // 2, dtype=x.dtype, device=x.device)
    pair_out = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)
    flat_weights = weights.reshape(-1).to(torch.float32).contiguous()
    if fp8 is not None:
        gate_up_scale, down_scale, block = fp8
        x_q, x_scale = quantize_activation_groups(x, block[1], backend="triton")
        gate_up_swiglu(x_q, gate_up, blocks, top_k, config["gate_up"], act, x_scale, gate_up_scale, block)
        act_q, act_scale = quantize_activation_groups(act, block[1], backend="triton")
        down_weighted(act_q, down, flat_weights, blocks, top_k, config["down"], pair_out, act_scale, down_scale, block)
    else:
        gate_up_swiglu(x, gate_up, blocks, top_k, config["gate_up"], act)
        down_weighted(act, down, flat_weights, blocks, top_k, config["down"], pair_out)
    combine(pair_out.view(num_tokens, top_k, hidden), out, shared, shared_gate_logit)
