"""KV-cache sizing: how many token slots the full-attention layers get when `max_total_token_num` is not given.

The runner loads the weights, fits its request slots to what they leave (`fitted_request_slots`: a
--max_running_requests whose linear state cannot fit is lowered, with a warning, rather than failing the start),
allocates the linear-attention state, then asks `kv_tokens_for_memory` for the KV size, so the sizing sees exactly
what is left. On CUDA the answer comes from a memory probe (free,
total and this process's bytes of the device); on CPU there is no device memory to size from, so every request
slot gets a full-length request's worth of tokens, capped.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lightllm.worker.config import RunnerConfig
from lightllm.worker.transfer.prefix import state_fraction


@dataclass(frozen=True)
class DeviceMemory:
    """Bytes of the runner's device: `free` and `total` as the driver reports them, `own` what this process's
    allocator holds (weights, state) once its cached temporaries are returned."""

    free: int
    total: int
    own: int


# `() -> DeviceMemory` of the runner's device, read after weights and state are allocated
MemoryProbe = Callable[[], DeviceMemory]

# KV tokens on CPU when max_total_token_num is not given (no device memory to size it from)
CPU_MAX_KV_TOKENS = 1 << 16
# device memory kept free for activations when sizing the KV cache from mem_fraction
ACTIVATION_RESERVE_BYTES = 1 << 30


def cuda_memory_probe(device: torch.device) -> MemoryProbe:
    """The real probe, read once the device's queued work (weight copies) has finished and the allocator's cached
    loading temporaries are returned to the driver. `own` comes from this process's allocator, not from a
    difference of free bytes, so a second server starting on the same device at the same time does not count."""

    def probe() -> DeviceMemory:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        return DeviceMemory(int(free), int(total), int(torch.cuda.memory_reserved(device)))

    return probe


# the most of what the weights leave (after the activation reserve and one longest request's KV) that the request
# slots' linear state may take when --max_running_requests asks for more than fits: the rest is the KV cache's
STATE_SHARE = 0.8


def fitted_request_slots(
    memory: DeviceMemory,
    *,
    requested: int,
    mem_fraction: float,
    state_bytes_per_request: int,
    kv_bytes_per_token: int,
    max_req_total_len: int,
    reserve_bytes: int = ACTIVATION_RESERVE_BYTES,
) -> int:
    """Request slots to allocate: `requested` where their linear state fits what this process's share leaves after
    the weights (`memory.own`), the activation reserve and the KV of one `max_req_total_len`-token request; else as
    many as fit in `STATE_SHARE` of that room (at least one), so the KV cache keeps the rest."""
    room = min(int(memory.total * mem_fraction) - memory.own, memory.free) - reserve_bytes
    room -= kv_bytes_per_token * max_req_total_len
    if room < 0 or state_bytes_per_request * requested <= room:
        # (room < 0: not even one request's KV fits, which the KV sizing refuses, naming the flags)
        return requested
    # at least one: where even its state does not fit, the KV sizing after it refuses the start, naming the flags
    return max(int(room * STATE_SHARE) // state_bytes_per_request, 1)


def cpu_kv_tokens(max_running_requests: int, max_req_total_len: int) -> int:
    """CPU rule: every request slot at full length, capped at `CPU_MAX_KV_TOKENS`."""
    return min(max_running_requests * max_req_total_len, CPU_MAX_KV_TOKENS)


def kv_tokens_for_memory(
    memory: DeviceMemory,
    *,
    mem_fraction: float,
    bytes_per_token: int,
    fixed_bytes: int,
    max_req_total_len: int,
    reserve_bytes: int = ACTIVATION_RESERVE_BYTES,
) -> int:
    """KV tokens that fit in this process's share `total * mem_fraction` of the device.

    The share is per process, so two servers (a prefill and a decode node, say) can each take a part of one
    device: what this process already holds (`own`: weights, state) counts against its share, memory of other
    processes does not, except that the KV cache never takes more than is `free`. `reserve_bytes` for activations
    and `fixed_bytes` of KV bookkeeping that does not scale with the token count (slot tables, the hold slot, the
    MTP head's extra slots) come out of it as well. Raises ValueError naming the flags to change when not even one
    `max_req_total_len`-token request fits.
    """
    if bytes_per_token <= 0:
        raise ValueError(f"bytes_per_token must be positive, got {bytes_per_token}")
    share_left = int(memory.total * mem_fraction) - memory.own
    budget = min(share_left, memory.free) - reserve_bytes - fixed_bytes
    tokens = max(budget, 0) // bytes_per_token
    if tokens < max_req_total_len:
        gib = 1 << 30
        if share_left <= memory.free:
            why = (
                f"--mem_fraction {mem_fraction} of {memory.total / gib:.1f} GiB, with {memory.own / gib:.1f} GiB "
                "held by this server (weights, linear-attention state)"
            )
            fix = "raise --mem_fraction"
        else:
            why = (
                f"{memory.free / gib:.1f} GiB free on the device ({(memory.total - memory.free - memory.own) / gib:.1f}"
                " GiB held by other processes)"
            )
            fix = "free the device, lower --mem_fraction of the other servers on it"
        raise ValueError(
            f"{why} and {reserve_bytes / gib:.1f} GiB kept for activations leave room for {tokens} KV tokens, fewer "
            f"than one {max_req_total_len}-token request: {fix}, or lower --max_req_total_len / "
            "--max_running_requests"
        )
    return tokens


def kv_row_lengths(c: RunnerConfig, max_width: int, mtp_step: int) -> tuple[int, int]:
    """Columns of a request's KV slot table: the longest request, and with an MTP head the room two verify windows
    need past it (an overlapped verify step and its successor are launched before the host knows whether the first
    one reached the request's limit; the tokens past it are dropped). The MTP head's table holds one more verify
    window."""
    longest = c.max_req_total_len + (2 * max_width if mtp_step else 0)
    return longest, longest + mtp_step + 1


def mtp_extra_tokens(c: RunnerConfig, mtp_step: int) -> int:
    """Token slots the MTP head's KV holds beyond the main KV's: one verify window per request."""
    return c.max_running_requests * (mtp_step + 1)


def runner_kv_tokens(runner, shapes: tuple[tuple[int, ...], ...], probe: MemoryProbe | None) -> int:
    """KV token slots for `runner`, whose weights and state are already allocated: `max_total_token_num` when
    given; else what `mem_fraction` of the device leaves after them, the per-layer hold slots, the slot tables and
    the prefix cache's checkpoint pool (`shapes`: one token's KV tensors per attention layer)."""
    c = runner.config
    if c.max_total_token_num is not None:
        return c.max_total_token_num
    probe = memory_probe_of(runner.device, probe)
    if probe is None:
        return cpu_kv_tokens(c.max_running_requests, c.max_req_total_len)
    per_layer = _kv_layer_bytes(shapes, runner.dtype)
    num_layers, mtp = len(runner.model_config.full_layer_ids), 1 if runner.mtp_step else 0
    # per layer: the hold slot (and on the MTP head its extra slots); per cache: an int64 slot table
    fixed = per_layer * (num_layers + mtp * (1 + mtp_extra_tokens(c, runner.mtp_step)))
    main_row, head_row = kv_row_lengths(c, runner.max_width, runner.mtp_step)
    fixed += 8 * c.max_running_requests * (main_row + mtp * head_row)
    bytes_per_token = per_layer * (num_layers + mtp)
    if not c.disable_prefix_cache:
        # the checkpoint pool comes out of the same budget: a fixed size, or a share of every KV token's bytes
        if c.prefix_cache_state_bytes is not None:
            fixed += c.prefix_cache_state_bytes
        else:
            bytes_per_token = int(bytes_per_token * (1 + state_fraction(c.prefix_cache_state_fraction)))
    return kv_tokens_for_memory(
        probe(),
        mem_fraction=c.mem_fraction,
        bytes_per_token=bytes_per_token,
        fixed_bytes=fixed,
        max_req_total_len=c.max_req_total_len,
    )


def memory_probe_of(device: torch.device, probe: MemoryProbe | None) -> MemoryProbe | None:
    """`probe` where given, else the device's (None on CPU: no device memory to size from)."""
    if probe is not None or device.type == "cpu":
        return probe
    return cuda_memory_probe(device)


def _kv_layer_bytes(shapes: tuple[tuple[int, ...], ...], dtype: torch.dtype) -> int:
    return sum(math.prod(s) for s in shapes) * torch.empty((), dtype=dtype).element_size()


def kv_bytes_per_token(shapes: tuple[tuple[int, ...], ...], dtype: torch.dtype, num_layers: int) -> int:
    """One token's KV over `num_layers` attention layers (`shapes`: one token's KV tensors per layer)."""
    return _kv_layer_bytes(shapes, dtype) * num_layers
