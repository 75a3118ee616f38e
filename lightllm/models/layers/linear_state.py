"""Run one linear-attention layer's recurrence over a step through the state protocol.

Prefill tokens (flat, first `num_prefill_tokens`) go to `state.prefill`; decode tokens are already a dense
`[rows, W]` block (see `models/context.py`), viewed as windows for `state.decode`. Mixers never see the state mode.
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
    num_prefill = ctx.num_prefill_tokens
    rows = ctx.decode_rows
    if rows is None:
        return ctx.state.prefill(layer, ctx.prefill_rows, mixed_qkv, graw, braw, params)
    outputs = []
    if num_prefill:
        prefill = (mixed_qkv[:num_prefill], graw[:num_prefill], braw[:num_prefill])
        outputs.append(ctx.state.prefill(layer, ctx.prefill_rows, *prefill, params))
    n, w = rows.slots.shape[0], rows.max_width

    def windows(x: torch.Tensor) -> torch.Tensor:
        return x[num_prefill:].view(n, w, *x.shape[1:])

    od = ctx.state.decode(layer, rows, windows(mixed_qkv), windows(graw), windows(braw), params)
    outputs.append(od.reshape(n * w, num_v_heads, head_v_dim))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)
