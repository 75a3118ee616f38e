"""Which rows of a step's logits cannot be sampled from: a NaN or +inf anywhere (the softmax of either is NaN,
and a NaN distribution draws token 0 for ever), or no finite value at all. A -inf alone is a mask (a grammar writes
them) and is fine. Such a row ends its request alone with reason `error` and `NONFINITE_LOGITS_ERROR`."""

from __future__ import annotations

import torch

NONFINITE_LOGITS_ERROR = "the model produced NaN or infinite logits"


def nonfinite_rows(logits: torch.Tensor) -> torch.Tensor:
    """[N] bool for `logits` [N, V] (any float dtype, any device; no host sync). One reduction: a row's maximum is
    NaN when it holds a NaN (torch's max propagates it), +inf when it holds a +inf, and -inf when nothing in it
    is finite; finite otherwise."""
    return ~torch.isfinite(logits.amax(dim=-1))
