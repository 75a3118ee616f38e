"""The runner's side of prefill/decode disaggregation: a request's committed state out of one runner and into a
fresh slot of another.

What moves is what a decode step reads: the KV of every committed token (full-attention layers), the canonical
linear-attention state (`export_checkpoint`: SSM with any pending history folded in, and the accepted conv
window), and with MTP the head's committed KV entries and the main model's hidden state of the last committed
token. `import_checkpoint` clears the destination slot's replay cursor, compact pending window and native slot
index, so the destination may run another state mode than the source.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lightllm.cache.payload import RequestState, TensorBlob
from lightllm.linear_att.base import Checkpoint


def host_blobs(tensors: list[torch.Tensor]) -> list[TensorBlob]:
    """The default packing: a host copy of each tensor, its bytes in the message."""
    return [TensorBlob.of(t) for t in tensors]


def export_request(runner, req, pack: Callable[[list[torch.Tensor]], list[TensorBlob]]) -> RequestState:
    """The committed state of one request of `runner` (its record `req`), its tensors packed by `pack` (host
    bytes by default; a device transport packs them into its staging region). The runner checks that no verify
    is pending."""
    n = req.num_tokens
    slots = runner.kv.slots(req.handle)[:n].to(runner.device)
    tensors = [buf[:, slots] for buf in runner.kv.buffers]
    ckpt = runner.state.export_checkpoint(torch.full((1,), req.state_slot, dtype=torch.int32, device=runner.device))
    tensors += [ckpt.conv, ckpt.ssm]
    drafter = runner.drafter
    mtp_len = 0
    if drafter is not None:
        if req.mtp_hidden or req.mtp_last_hidden is None:
            raise RuntimeError(f"request {req.handle}: MTP pairs pending; export after the draft that follows a step")
        mtp_slots = drafter.kv.slots(req.handle)[: req.mtp_len].to(runner.device)
        tensors += [buf[:, mtp_slots] for buf in drafter.kv.buffers]
        source, row = req.mtp_last_hidden
        tensors.append(source[row : row + 1])
        mtp_len = req.mtp_len
    return request_state_of(pack(tensors), n, len(runner.kv.buffers), mtp_len if drafter is not None else None)


def request_state_of(blobs: list[TensorBlob], num_tokens: int, num_kv: int, mtp_len: int | None) -> RequestState:
    """A `RequestState` of blobs in export order: the KV components, conv, SSM and, with MTP (`mtp_len` not None),
    the head's KV components and the last hidden state."""
    state = RequestState(num_tokens, blobs[:num_kv], blobs[num_kv], blobs[num_kv + 1])
    if mtp_len is not None:
        state.mtp_kv, state.mtp_len, state.mtp_hidden = blobs[num_kv + 2 : -1], mtp_len, blobs[-1]
    return state


def import_request(runner, req, state: RequestState, region: torch.Tensor | None = None) -> None:
    """Fill `runner`'s fresh request `req` (just added, nothing committed) with `state`. Blobs whose bytes lie in
    a device region are read from `region` (flat uint8, on this runner's device or in host memory). On an error
    the caller frees the request."""
    if (runner.drafter is None) != (state.mtp_hidden is None):
        raise RuntimeError("MTP state sent to a runner without drafter, or missing for one with a drafter")
    device = runner.device

    def tensor(blob: TensorBlob) -> torch.Tensor:
        if blob.offset is None:
            return blob.tensor(device)
        if region is None:
            raise RuntimeError("the transfer's state lies in a device region this node was not given")
        return blob.view_in(region).to(device)  # a region kept in host memory moves here

    slots = torch.from_numpy(runner.kv.extend_many([req.handle], [state.num_tokens])).to(device)
    for buf, blob in zip(runner.kv.buffers, state.kv):
        buf[:, slots] = tensor(blob).to(buf.dtype)
    conv, ssm = tensor(state.conv), tensor(state.ssm)
    slot = torch.full((1,), req.state_slot, dtype=torch.int32, device=device)
    runner.state.import_checkpoint(slot, Checkpoint(conv=conv, ssm=ssm))
    req.num_tokens = state.num_tokens
    if runner.drafter is not None:
        mtp_kv = runner.drafter.kv
        mtp_slots = torch.from_numpy(mtp_kv.extend_many([req.handle], [state.mtp_len])).to(device)
        for buf, blob in zip(mtp_kv.buffers, state.mtp_kv):
            buf[:, mtp_slots] = tensor(blob).to(buf.dtype)
        req.mtp_len = state.mtp_len
        req.mtp_hidden, req.mtp_next_ids = [], []
        req.mtp_last_hidden = (tensor(state.mtp_hidden).to(runner.dtype).clone(), 0)
