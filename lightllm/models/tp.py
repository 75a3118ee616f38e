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

    def min_over_ranks(self, value: int, device: torch.device) -> int:
        """The smallest `value` of all ranks (sizes every rank must agree on, e.g. KV slots from free memory)."""
        if self.size == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

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


def tp_size_problem(cfg, size: int) -> str | None:
    """Why a `ModelConfig` cannot be split over `size` ranks (None when it can): every sharded dimension must
    divide evenly; attention KV heads may also be fewer than the ranks when they divide the rank count (each KV
    head is then replicated)."""
    if size < 1:
        return f"--tp must be >= 1, got {size}"
    if size == 1:
        return None
    a, lin = cfg.attention, cfg.linear
    counts = {
        "vocab_size": cfg.vocab_size,
        "attention heads (num_attention_heads)": a.num_heads,
        "linear-attention key heads": lin.num_k_heads,
        "linear-attention value heads": lin.num_v_heads,
        "intermediate_size": cfg.intermediate_size,
    }
    if cfg.moe is not None:
        counts["moe_intermediate_size"] = cfg.moe.intermediate_size
        if cfg.moe.shared_intermediate_size:
            counts["shared expert intermediate size"] = cfg.moe.shared_intermediate_size
    bad = [f"{name} = {n}" for name, n in counts.items() if n % size]
    if a.kind != "mla" and a.num_kv_heads % size and size % a.num_kv_heads:
        bad.append(f"attention KV heads (num_key_value_heads) = {a.num_kv_heads} (neither divides the other)")
    if not bad:
        return None
    return f"--tp {size} does not split this model evenly: " + "; ".join(bad) + f" (each must be a multiple of {size})"
