"""Numeric comparison helpers used by every kernel and model test."""

from __future__ import annotations

import torch


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative RMS error ||actual - expected|| / ||expected|| in fp64; inf if either side has a NaN/inf."""
    a = actual.detach().double().cpu()
    e = expected.detach().double().cpu()
    assert a.shape == e.shape, f"shape {tuple(a.shape)} != expected {tuple(e.shape)}"
    if not torch.isfinite(a).all() or not torch.isfinite(e).all():
        return float("inf")
    denom = e.norm().item()
    diff = (a - e).norm().item()
    return diff / denom if denom > 0 else diff


def assert_rel_close(name: str, actual: torch.Tensor, expected: torch.Tensor, max_rel: float) -> None:
    """Fail with the named quantity's relative error when it exceeds `max_rel` (NaN always fails)."""
    err = relative_error(actual, expected)
    assert err <= max_rel, f"{name}: relative error {err:.3e} > {max_rel:.1e}"


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill a buffer that a kernel must overwrite with NaN (or the integer minimum) and return it."""
    if t.is_floating_point():
        return t.fill_(float("nan"))
    return t.fill_(torch.iinfo(t.dtype).min)


def ranks_match(ranks, prompt: list[int], logp: torch.Tensor, shift: int = 0, tol: float = 1e-4) -> bool:
    """Whether `ranks` (vLLM's prompt ranks: None, then 1 for the most likely) give each prompt token p's place
    among `logp`'s row of position p - 1 + shift ([T, V] log-probabilities of a reference forward), up to the
    tokens within `tol` of it (two forwards round apart)."""
    if ranks[0] is not None or len(ranks) != len(prompt):
        return False
    for p in range(1, len(prompt)):
        row = logp[min(p - 1 + shift, len(prompt) - 1)]
        mine = row[prompt[p]]
        if not int((row > mine + tol).sum()) + 1 <= ranks[p] <= int((row >= mine - tol).sum()):
            return False
    return True
