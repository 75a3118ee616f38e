"""Host-side helpers shared by the kernel wrappers: input checks and the launch configuration of each family."""

from __future__ import annotations

import functools

import torch
import triton

from lightllm.linear_att import autotune
from lightllm.linear_att.registry import algorithm_of_gate


def check_verify_inputs(tokens, slots, widths) -> None:
    """Shapes, dtypes and the strides the verify kernels assume (innermost head / channel dims contiguous) of a
    `TokenInputs` and its rows."""
    q, k, v, graw, braw, A_log, dt_bias = tokens.pointers
    N, WMAX, H, K = q.shape
    HV, V, GK = v.shape[2], v.shape[3], graw.shape[-1]
    assert k.shape == q.shape and k.stride() == q.stride(), "q and k must have the same shape and strides"
    assert v.shape[:2] == (N, WMAX) and HV % H == 0, f"v {tuple(v.shape)} does not match q {tuple(q.shape)}"
    assert GK in (1, K), f"gate width must be 1 (GDN) or K={K} (KDA), got {GK}"
    assert graw.shape == (N, WMAX, HV, GK) and braw.shape == (N, WMAX, HV)
    assert q.stride(3) == 1 and q.stride(2) == K, "q/k heads must be contiguous [H, K]"
    assert v.stride(3) == 1 and v.stride(2) == V, "v heads must be contiguous [HV, V]"
    assert graw.stride(3) == 1 and graw.stride(2) == GK and braw.stride(2) == 1
    assert A_log.shape == (HV,) and A_log.is_contiguous()
    assert dt_bias.shape == (HV, GK) and dt_bias.is_contiguous()
    assert slots.shape == (N,) and widths.shape == (N,) and slots.dtype == widths.dtype == torch.int32


def verify_launch_args(tokens, state_pointers, state_strides, slots, widths, o) -> tuple:
    """The leading arguments of every verify kernel (serial, replay decode, replay window), in their order: the
    token pointers (a tuple), the state pointers (a tuple), slots, widths, o, scale, lower_bound, the token strides,
    o's row / token strides and the state strides (tuples)."""
    return (
        tokens.pointers,
        tuple(state_pointers),
        slots,
        widths,
        o,
        tokens.kernel_scale,
        tokens.lower_bound,
        tokens.strides,
        tuple(o.stride()[:2]),
        tuple(state_strides),
    )


def state_shape(H: int, HV: int, K: int, V: int, GK: int, block_v: int) -> dict[str, int]:
    """The shape constexprs every state kernel takes: heads, head dims and gate width, and the blocks of one
    program (K and the gate width rounded up to powers of two, the V tile `block_v`)."""
    return dict(H=H, HV=HV, K=K, V=V, GK=GK, BK=triton.next_power_of_2(K), BV=block_v, BG=triton.next_power_of_2(GK))


def tuned(config, algorithm, GK: int, K: int, key: autotune.TuneKey) -> autotune.KernelConfig:
    """The configuration of one launch: `config` when the caller pins one, else `algorithm`'s table entry for
    `key` (no algorithm given: the one whose gate width `GK` is, `registry.algorithm_of_gate`)."""
    if config is not None:
        return config
    if algorithm is None:
        algorithm = algorithm_of_gate(GK, K)
    return algorithm.lookup(key)


def serial_config(
    config, algorithm, state_dtype, act_dtype, H, HV, K, V, GK, width, device, lower_bound=None, compact=False
):
    """The tiling of the serial kernel body: native verify's ("serial") or compact's ("compact", which borrows the
    serial entry where it has none; the two modes' outputs are bitwise equal only under the same tiling)."""
    family = "compact" if compact else "serial"
    key = autotune.make_key(family, device, state_dtype, act_dtype, H, HV, K, V, GK, width, lower_bound=lower_bound)
    return tuned(config, algorithm, GK, K, key)


def filled_block_v(block_v: int, V: int, programs_per_tile: int, num_sms: int) -> int:
    """The V tile of a launch with `programs_per_tile` programs per V tile (rows x value heads): the tuned
    `block_v` (capped at V), halved while the launch would occupy at most half of the `num_sms` multiprocessors,
    down to 16. A table entry is tuned at hundreds of rows; a batch of one or two rows would leave the GPU mostly
    idle under it, and a narrower tile puts more programs on the same work."""
    BV = min(block_v, triton.next_power_of_2(V))
    while BV > 16 and 2 * programs_per_tile * triton.cdiv(V, BV) <= num_sms:
        BV //= 2
    return BV


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device; 0 elsewhere (no tile is narrowed)."""
    if device.type != "cuda":
        return 0
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


def replay_config(
    config,
    algorithm,
    state_dtype,
    act_dtype,
    H,
    HV,
    K,
    V,
    GK,
    width,
    replay_capacity,
    projection,
    device,
    lower_bound=None,
):
    key = autotune.make_key(
        "replay", device, state_dtype, act_dtype, H, HV, K, V, GK, width, replay_capacity, projection, lower_bound
    )
    return tuned(config, algorithm, GK, K, key)


def fold_config(config, algorithm, state_dtype, H, HV, K, V, GK, replay_capacity, device) -> autotune.KernelConfig:
    key = autotune.make_key("replay_fold", device, state_dtype, torch.float32, H, HV, K, V, GK, 0, replay_capacity)
    return tuned(config, algorithm, GK, K, key)
