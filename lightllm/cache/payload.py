"""A request's committed state as bytes: what moves between runners (prefill/decode disaggregation).

The bytes of a `TensorBlob` travel in the message (`data`), or lie in a device region the receiver reads directly
(`offset` into that region, CUDA IPC); either way the blob carries the dtype and shape."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import torch


class TensorBlob(msgspec.Struct):
    """One tensor: dtype name (torch), shape, raw bytes (little-endian, C order) or where they lie in a device
    region."""

    dtype: str
    shape: list[int]
    data: bytes
    # not None: the bytes are at this byte offset of the transfer's device region and `data` is empty
    offset: int | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * getattr(torch, self.dtype).itemsize

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorBlob:
        t = tensor.detach().contiguous().cpu()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return cls(str(t.dtype).removeprefix("torch."), list(t.shape), raw)

    def tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        if self.offset is not None:
            raise ValueError("this blob's bytes lie in a device region: read them with `view_in`")
        dtype = getattr(torch, self.dtype)
        if not self.data:
            return torch.zeros(self.shape, dtype=dtype, device=device)
        flat = torch.from_numpy(np.frombuffer(self.data, dtype=np.uint8).copy())
        return flat.view(dtype).reshape(self.shape).to(device)

    def view_in(self, region: torch.Tensor) -> torch.Tensor:
        """The tensor whose bytes lie in `region` (a flat uint8 tensor) at `offset`: a view, no copy."""
        raw = region[self.offset : self.offset + self.nbytes]
        return raw.view(getattr(torch, self.dtype)).reshape(self.shape)


class RequestState(msgspec.Struct):
    """What a decode node needs to continue a prefilled request exactly as the prefill node would have.

    KV and conv windows are in the activation dtype, SSM states in the state dtype, heads in global order."""

    num_tokens: int
    # per full-attention KV component (K, V; or MLA's latent): [num full layers, num_tokens, *token shape]
    kv: list[TensorBlob]
    # the linear layers' canonical state: conv [NL, 1, C, Kc - 1], ssm [NL, 1, HV, K, V]
    conv: TensorBlob
    ssm: TensorBlob
    # MTP: the head's KV entries committed so far ([1, mtp_len, *token shape] per component) and the main model's
    # hidden state at the last committed token ([1, hidden])
    mtp_kv: list[TensorBlob] = msgspec.field(default_factory=list)
    mtp_len: int = 0
    mtp_hidden: TensorBlob | None = None
