"""Tensor-parallel placement: which shard of a weight this rank keeps, and the collectives after sharded GEMMs.

Column-parallel weights (output rows split) need no communication; row-parallel weights (input columns split)
produce partial sums that `all_reduce` completes. With `size == 1` every hook is the identity.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TPInfo:
    rank: int = 0
    size: int = 1
    # torch.distributed process group (None = the default group); unused when size == 1
    group: object | None = None

    def shard(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's equal slice of `dim` (the dim must divide evenly)."""
        if self.size == 1:
            return t
        n = t.shape[dim]
        assert n % self.size == 0, f"dim {dim} of size {n} does not split over tp={self.size}"
        return t.narrow(dim, self.rank * (n // self.size), n // self.size)

    def shard_heads(self, t: torch.Tensor, dim: int, num_heads: int) -> torch.Tensor:
        """Slice whole heads of `dim`; with fewer heads than ranks each head is replicated on size/heads ranks."""
        if self.size == 1:
            return t
        if num_heads >= self.size:
            return self.shard(t, dim)
        assert self.size % num_heads == 0, f"{num_heads} heads cannot be spread over tp={self.size}"
        head = self.rank // (self.size // num_heads)
        width = t.shape[dim] // num_heads
        return t.narrow(dim, head * width, width)

    def local_heads(self, num_heads: int) -> int:
        return max(num_heads // self.size, 1)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` along the last dim (vocab-parallel logits)."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)
