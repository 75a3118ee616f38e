"""Host-side helpers shared by the kernel wrappers: input checks and the launch configuration of each family."""

from __future__ import annotations

import torch

from lightllm.linear_att import autotune


def check_verify_inputs(q, k, v, graw, braw, A_log, dt_bias, slots, widths) -> None:
    """Shapes, dtypes and the strides the verify kernels assume (innermost head / channel dims contiguous)."""
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


def serial_config(state_dtype, act_dtype, H, HV, K, V, GK, width, device) -> autotune.KernelConfig:
    """Native verify, compact verify and compact commit share one tiling (bitwise equality needs it)."""
    return autotune.lookup(autotune.make_key("serial", device, state_dtype, act_dtype, H, HV, K, V, GK, width))


def replay_config(state_dtype, act_dtype, H, HV, K, V, GK, width, capacity, projection, device):
    key = autotune.make_key("replay", device, state_dtype, act_dtype, H, HV, K, V, GK, width, capacity, projection)
    return autotune.lookup(key)


def fold_config(state_dtype, H, HV, K, V, GK, capacity, device) -> autotune.KernelConfig:
    key = autotune.make_key("replay_fold", device, state_dtype, torch.float32, H, HV, K, V, GK, 0, capacity)
    return autotune.lookup(key)
