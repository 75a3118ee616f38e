"""KV-cache sizing: how many token slots the full-attention layers get when `max_total_token_num` is not given.

The runner loads the weights and allocates the linear-attention state first, then asks `kv_tokens_to_allocate`
for the KV size, so the sizing sees exactly what is left. On CUDA the answer comes from a memory probe
(`(free, total)` bytes of the device); on CPU there is no device memory to size from, so every request slot gets
a full-length request's worth of tokens, capped.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# `() -> (free_bytes, total_bytes)` of the runner's device, read after weights and state are allocated
MemoryProbe = Callable[[], tuple[int, int]]

# KV tokens on CPU when max_total_token_num is not given (no device memory to size it from)
CPU_MAX_KV_TOKENS = 1 << 16
# device memory kept free for activations when sizing the KV cache from mem_fraction
ACTIVATION_RESERVE_BYTES = 1 << 30


def cuda_memory_probe(device: torch.device) -> MemoryProbe:
    """The real probe: free and total bytes of `device` once its queued work (weight copies) has finished and
    the allocator's cached loading temporaries are returned to the driver."""

    def probe() -> tuple[int, int]:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        return int(free), int(total)

    return probe


def cpu_kv_tokens(max_running_requests: int, max_req_total_len: int) -> int:
    """CPU rule: every request slot at full length, capped at `CPU_MAX_KV_TOKENS`."""
    return min(max_running_requests * max_req_total_len, CPU_MAX_KV_TOKENS)


def kv_tokens_for_memory(
    free: int,
    total: int,
    *,
    mem_fraction: float,
    bytes_per_token: int,
    fixed_bytes: int,
    max_req_total_len: int,
    reserve_bytes: int = ACTIVATION_RESERVE_BYTES,
) -> int:
    """KV tokens that fit in `total * mem_fraction`, given `free` bytes left after weights and state.

    Everything already in use (`total - free`: weights, state, other processes) counts against the budget, as do
    `reserve_bytes` for activations and `fixed_bytes` of KV bookkeeping that does not scale with the token count
    (slot tables, the hold slot, the MTP head's extra slots). Raises ValueError naming the flags to change when
    not even one `max_req_total_len`-token request fits.
    """
    if bytes_per_token <= 0:
        raise ValueError(f"bytes_per_token must be positive, got {bytes_per_token}")
    used = total - free
    budget = int(total * mem_fraction) - used - reserve_bytes - fixed_bytes
    tokens = max(budget, 0) // bytes_per_token
    if tokens < max_req_total_len:
        gib = 1 << 30
        raise ValueError(
            f"--mem_fraction {mem_fraction} of {total / gib:.1f} GiB, with {used / gib:.1f} GiB already in use "
            f"(weights, linear-attention state, other processes) and {reserve_bytes / gib:.1f} GiB kept for "
            f"activations, leaves room for {tokens} KV tokens, fewer than one {max_req_total_len}-token request: "
            "raise --mem_fraction, or lower --max_req_total_len / --max_running_requests"
        )
    return tokens
