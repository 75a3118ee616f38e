"""What every memcheck case is made of: `Case` (the kernels it must launch, the function it runs) and `Ctx`
(device, seeded generator, exact-size allocation helpers)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Case:
    family: str
    shape: str
    detail: str
    kernels: tuple[str, ...]  # every kernel the case must launch
    tiny: bool
    run: Callable[[Ctx], str | None]  # returns an optional note for its line

    @property
    def id(self) -> str:
        return f"{self.family}/{self.shape}/{self.detail}"


class Ctx:
    """Device, seeded generator and exact-size allocation helpers of one case."""

    def __init__(self, device: str, seed: int):
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self.gen = torch.Generator(device=self.device).manual_seed(seed)
        self.cpu_gen = torch.Generator().manual_seed(seed)

    def dtype(self, name: str):
        return getattr(self.torch, name)

    def randn(self, *shape, dtype="float32", scale=1.0):
        t = self.torch.randn(*shape, generator=self.gen, device=self.device)
        return (t * scale).to(self.dtype(dtype) if isinstance(dtype, str) else dtype)

    def rand(self, *shape, scale=1.0):
        return self.torch.rand(*shape, generator=self.gen, device=self.device) * scale

    def ints(self, values):
        return self.torch.tensor(list(values), dtype=self.torch.int32, device=self.device)

    def to_device(self, t):
        return t.to(self.device)
