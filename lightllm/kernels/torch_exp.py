"""The exponential eager torch uses on CUDA, for kernels that promise torch's numbers bit for bit.

torch's CUDA elementwise ops (silu, sigmoid) call libdevice's `expf` and divide with IEEE rounding; Triton's
`tl.exp` lowers to a faster, less exact exponential. Under Triton's interpreter there is no libdevice, so kernels
take the flag `LIBDEVICE_EXP=libdevice_exp(kernel)` and fall back to `tl.exp` there.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.runtime.interpreter import InterpretedFunction


def libdevice_exp(kernel) -> bool:
    """Whether `kernel` compiles for a device (libdevice's `expf` available) rather than running interpreted."""
    return not isinstance(kernel, InterpretedFunction)


@triton.jit
def torch_exp(x, LIBDEVICE_EXP: tl.constexpr):
    """`exp(x)` of fp32 `x` as torch's CUDA kernels compute it (libdevice's `expf`), or `tl.exp` interpreted."""
    if LIBDEVICE_EXP:
        return libdevice.exp(x)
    else:
        return tl.exp(x)
