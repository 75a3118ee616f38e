"""A decode node's side of a device-region read, in a spawned process of its own.

The child must import its target by module name, so it lives here and not in a test module (pytest imports those
under names a spawned process cannot import). A child that fails sends its traceback instead of tensors; the
parent raises it, and a child that hangs or dies fails the test after `timeout_s` instead of blocking it.
"""

from __future__ import annotations

import multiprocessing as mp
import traceback

import msgspec
import torch

from lightllm.cache.payload import TensorBlob
from lightllm.server.pd.cuda_ipc import CudaIpcHandle, CudaIpcReads
from lightllm.server.pd.staging import DeviceRegion, RegionReader


def _child(wire: bytes, conn) -> None:
    try:
        region = msgspec.msgpack.decode(wire, type=DeviceRegion)
        local = RegionReader("cuda", {CudaIpcHandle: CudaIpcReads()}, ["cuda_ipc@here"]).pull(region)
        # plain bytes: a pickled torch tensor is passed as a shared-memory handle that this process serves, and
        # it may have exited by the time the parent unpickles it
        conn.send(("ok", local.cpu().numpy().tobytes()))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def read_region_in_child(region: DeviceRegion, blobs: list[TensorBlob], timeout_s: float = 120.0) -> list[torch.Tensor]:
    """The blobs' tensors as another process reads them from `region` by CUDA IPC (on the CPU)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(msgspec.msgpack.encode(region), child))
    proc.start()
    child.close()  # the child's end lives in the child only: its exit then ends our wait
    try:
        if not parent.poll(timeout_s):
            raise TimeoutError(f"the reader process sent nothing in {timeout_s} s (exit code {proc.exitcode})")
        status, found = parent.recv()
    except EOFError:
        proc.join(10)
        raise RuntimeError(f"the reader process died without an answer (exit code {proc.exitcode})") from None
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    if status != "ok":
        raise RuntimeError(f"the reader process failed:\n{found}")
    local = torch.frombuffer(bytearray(found), dtype=torch.uint8)
    return [b.view_in(local) for b in blobs]
