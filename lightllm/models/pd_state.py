"""The runner's side of prefill/decode disaggregation: a request's committed state out of one runner and into a
fresh slot of another.

What moves is what a decode step reads: the KV of every committed token (full-attention layers), the canonical
linear-attention state (`export_checkpoint`: SSM with any pending history folded in, and the accepted conv
window), and with MTP the head's committed KV entries and the main model's hidden state of the last committed
token. `import_checkpoint` clears the destination slot's replay cursor, compact pending window and native slot
index, so the destination may run another state mode than the source.
"""

from __future__ import annotations

import torch

from lightllm.engine.transfer.payload import RequestState, TensorBlob
from lightllm.linear_att.base import Checkpoint


@torch.inference_mode()
def export_request(runner, handle: int) -> RequestState:
    """Host copy of the committed state of request `handle` (between steps: never between forward and accept)."""
    if hasattr(runner, "export_request"):
        # a tensor-parallel runner gathers every rank's heads itself
        return runner.export_request(handle)
    if runner._pending is not None:
        raise RuntimeError("export between forward and accept: the state is not committed")
    req = runner._requests[handle]
    n = req.num_tokens
    slots = runner.kv.slots(handle)[:n].to(runner.device)
    kv = [TensorBlob.of(buf[:, slots]) for buf in runner.kv.buffers]
    ckpt = runner.state.export_checkpoint(torch.tensor([req.state_slot], dtype=torch.int32, device=runner.device))
    state = RequestState(n, kv, TensorBlob.of(ckpt.conv), TensorBlob.of(ckpt.ssm))
    drafter = runner.drafter
    if drafter is not None:
        if req.mtp_hidden or req.mtp_last_hidden is None:
            raise RuntimeError(f"request {handle}: MTP pairs pending; export after the draft that follows a step")
        mtp_slots = drafter.kv.slots(handle)[: req.mtp_len].to(runner.device)
        state.mtp_kv = [TensorBlob.of(buf[:, mtp_slots]) for buf in drafter.kv.buffers]
        state.mtp_len = req.mtp_len
        source, row = req.mtp_last_hidden
        state.mtp_hidden = TensorBlob.of(source[row : row + 1])
    return state


@torch.inference_mode()
def import_request(runner, state: RequestState) -> int:
    """A new request holding `state` in a fresh state slot and KV row; returns its handle. Raises RuntimeError
    when no slot or not enough KV is free (nothing is kept then)."""
    if hasattr(runner, "import_request"):
        # a tensor-parallel runner hands every rank its heads itself
        return runner.import_request(state)
    if (runner.drafter is None) != (state.mtp_hidden is None):
        raise RuntimeError("MTP state sent to a runner without drafter, or missing for one with a drafter")
    handle = runner.add_request(None)
    try:
        req = runner._requests[handle]
        device = runner.device
        slots = torch.from_numpy(runner.kv.extend_many([handle], [state.num_tokens])).to(device)
        for buf, blob in zip(runner.kv.buffers, state.kv):
            buf[:, slots] = blob.tensor(device).to(buf.dtype)
        conv, ssm = state.conv.tensor(device), state.ssm.tensor(device)
        slot = torch.tensor([req.state_slot], dtype=torch.int32, device=device)
        runner.state.import_checkpoint(slot, Checkpoint(conv=conv, ssm=ssm))
        req.num_tokens = state.num_tokens
        if runner.drafter is not None:
            mtp_kv = runner.drafter.kv
            mtp_slots = torch.from_numpy(mtp_kv.extend_many([handle], [state.mtp_len])).to(device)
            for buf, blob in zip(mtp_kv.buffers, state.mtp_kv):
                buf[:, mtp_slots] = blob.tensor(device).to(buf.dtype)
            req.mtp_len = state.mtp_len
            req.mtp_hidden, req.mtp_next_ids = [], []
            req.mtp_last_hidden = (state.mtp_hidden.tensor(device).to(runner.dtype), 0)
    except Exception:
        runner.free_request(handle)
        raise
    return handle
