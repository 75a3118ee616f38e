"""Run one linear-attention layer's recurrence over a step through the state protocol.

Prefill tokens (flat, first `num_prefill_tokens`) go to `state.prefill`; decode tokens are laid out as
`[rows, Wmax]` windows for `state.decode` and scattered back. Mixers never see the state mode.
"""

from __future__ import annotations

import torch

from lightllm.linear_att.base import LayerParams
from lightllm.models.context import StepContext


def run_linear_state(
    ctx: StepContext,
    layer: int,
    mixed_qkv: torch.Tensor,
    graw: torch.Tensor,
    braw: torch.Tensor,
    params: LayerParams,
    num_v_heads: int,
    head_v_dim: int,
) -> torch.Tensor:
    """`mixed_qkv [T, C]` (pre-conv), `graw [T, HV, GK]`, `braw [T, HV]` -> `o [T, HV, V]`."""
    tp = ctx.num_prefill_tokens
    o = mixed_qkv.new_empty(mixed_qkv.shape[0], num_v_heads, head_v_dim)
    if tp:
        o[:tp] = ctx.state.prefill(layer, ctx.prefill_rows, mixed_qkv[:tp], graw[:tp], braw[:tp], params)
    if ctx.decode_rows is not None:
        idx = ctx.decode_index
        od = ctx.state.decode(layer, ctx.decode_rows, mixed_qkv[tp:][idx], graw[tp:][idx], braw[tp:][idx], params)
        o[tp:][idx[ctx.decode_valid]] = od[ctx.decode_valid]
    return o
