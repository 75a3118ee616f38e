"""Torch twin of the causal depthwise conv + SiLU with a per-slot window (README "Conv window").

Vectorised over rows and channels; the only Python loop is over the `Kc` kernel taps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _taps(padded: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, num_out: int) -> torch.Tensor:
    """padded `[N, Kc - 1 + num_out, C]` fp32 -> silu(conv) `[N, num_out, C]` fp32 (tap j multiplies x_{t-Kc+1+j})."""
    w = weight.float()
    y = torch.zeros(padded.shape[0], num_out, padded.shape[2], dtype=torch.float32, device=padded.device)
    for j in range(w.shape[1]):
        y = y + padded[:, j : j + num_out] * w[:, j]
    if bias is not None:
        y = y + bias.float()
    return F.silu(y)


def _window_cols(conv_offset: torch.Tensor, slots: torch.Tensor, hist_len: int) -> torch.Tensor:
    """[N, hist_len] column indices of each row's accepted history."""
    off = conv_offset[slots].long()
    return off[:, None] + torch.arange(hist_len, device=off.device)


def causal_conv_prefill(x, conv, conv_offset, slots, cu_seqlens, weight, bias, has_initial_state):
    """See `lightllm.linear_att.ops.causal_conv_prefill`."""
    hist_len = weight.shape[1] - 1
    sl = slots.long()
    num_rows, num_ch = sl.numel(), x.shape[1]
    cu = cu_seqlens.long()
    lens = cu[1:] - cu[:-1]
    if num_rows == 0 or x.shape[0] == 0:
        return torch.zeros_like(x)
    max_len = int(lens.max())
    cols = _window_cols(conv_offset, sl, hist_len)
    # advanced indices around a slice put their dims first: [N, hist_len, C]
    hist = conv[sl[:, None], :, cols].float()
    hist = torch.where(has_initial_state.to(torch.bool)[:, None, None], hist, torch.zeros_like(hist))
    padded = torch.zeros(num_rows, hist_len + max_len, num_ch, dtype=torch.float32, device=x.device)
    padded[:, :hist_len] = hist
    row_of_token = torch.repeat_interleave(torch.arange(num_rows, device=x.device), lens)
    # tokens past the last row (padding of a fixed-size step) are in no row: they get zeros
    num_real = row_of_token.numel()
    pos_in_row = torch.arange(num_real, device=x.device) - cu[:-1][row_of_token]
    padded[row_of_token, hist_len + pos_in_row] = x[:num_real].float()
    y = torch.zeros_like(x)
    y[:num_real] = _taps(padded, weight, bias, max_len)[row_of_token, pos_in_row].to(x.dtype)
    tail = padded[torch.arange(num_rows, device=x.device)[:, None], lens[:, None] + torch.arange(hist_len)]
    live = lens > 0
    conv[sl[live][:, None], :, cols[live]] = tail[live].to(conv.dtype)
    return y


def causal_conv_decode(x, conv, conv_offset, slots, widths, weight, bias):
    """See `lightllm.linear_att.ops.causal_conv_decode`."""
    hist_len = weight.shape[1] - 1
    sl = slots.long()
    num_rows, max_width, _ = x.shape
    w = widths.long()
    cols = _window_cols(conv_offset, sl, hist_len)
    hist = conv[sl[:, None], :, cols].float()  # [N, hist_len, C]
    combined = torch.cat([hist, x.float()], dim=1)  # [N, hist_len + Wmax, C]
    tok = torch.arange(max_width, device=x.device)
    y = _taps(combined, weight, bias, max_width)
    y = torch.where((tok[None, :] < w[:, None])[..., None], y, torch.zeros_like(y)).to(x.dtype)
    live = w > 0
    if bool(live.any()):
        # the buffer becomes [history[1:] | x_0 .. x_{W-1}] in columns 0 .. Kc - 3 + W; later columns keep their bytes
        new = combined[live, 1 : 1 + conv.shape[-1]].transpose(1, 2).to(conv.dtype)  # [n, C, Wc]
        col = torch.arange(conv.shape[-1], device=x.device)
        keep_new = col[None, :] < (hist_len - 1 + w[live])[:, None]
        conv[sl[live]] = torch.where(keep_new[:, None, :], new, conv[sl[live]])
    return y
