"""An overlapped greedy MTP step as one CUDA graph per batch bucket: verify forward, acceptance, accept, drafts.

A verify step of full windows (W = mtp_step + 1 tokens a row) whose successor is launched before the host reads it
needs nothing from the host between its forward and its drafts: the windows come from the step before (on the
device), acceptance is an argmax comparison, the state's accept and the MTP head's commit take the counts as device
tensors. So the whole step is captured over the decode and draft buffers plus its own inputs:

1. the windows (first token and drafts) and the tokens each row committed in a step the host has not read
   (`extra`) are copied into `carry`; the decode buffers' positions and KV write slots are shifted by `extra`;
2. the decode forward and the LM head over every window position;
3. greedy acceptance (`verify_full_windows_on_device`): a row keeps its drafts while each equals the argmax before
   it, at most `room - extra` of them (a window never commits past the request's length limit), or exactly
   `kept` of them where `kept >= 0` (benchmarks' simulated acceptance);
4. the state's accept of those counts;
5. the MTP head commits each row's accepted (hidden, token) pairs and chains its drafts for the next window.

The host fills the decode and draft buffers (positions, KV slots, lengths) as for any step, with the KV of the
worst case (W more tokens a row) allocated, then replays once. HOLD rows (past the real batch) have width 0: no
state, KV or head entry changes. Outputs are the graph's buffers; the caller clones them before the next replay.
On the CPU (or with graphs off) the same function runs eagerly over the same buffers.
"""

from __future__ import annotations

import numpy as np
import torch

from lightllm.cache.device_copy import copy_to_device
from lightllm.engine.speculative.verify import VerifyFigures, verify_full_windows_on_device
from lightllm.worker.graphs.buckets import BucketGraphs
from lightllm.worker.graphs.decode import DecodeGraphs
from lightllm.worker.graphs.draft import DraftGraphs


class SpecStepGraphs:
    """Overlapped MTP steps of up to the decode buffers' `max_batch` rows (see the module docstring)."""

    def __init__(self, model, state, decode: DecodeGraphs, draft: DraftGraphs, use_graphs: bool):
        if draft.width != decode.width or draft.mtp_step != decode.width - 1:
            raise ValueError(f"decode width {decode.width} and {draft.mtp_step} drafts of width {draft.width}")
        self.model, self.state, self.decode, self.draft = model, state, decode, draft
        self.width = decode.width
        self.figures = VerifyFigures(self.width)
        self._graphs = BucketGraphs(decode.buckets, self.forward, self.fill_hold, "overlapped MTP steps")
        max_batch, device = decode.max_batch, decode.kv.device
        # per row: the window (first token, drafts) and the tokens committed in steps the host has not read
        self._carry = torch.zeros(max_batch, self.width + 1, dtype=torch.int64, device=device)
        # per row, from the host: the most drafts it may keep, and simulated acceptance's kept count (-1: none)
        self._limits = torch.zeros(max_batch, 2, dtype=torch.int64, device=device)
        self._host_limits = np.zeros((max_batch, 2), dtype=np.int64)
        self.use_graphs = use_graphs and device.type == "cuda"

    def bucket(self, num_rows: int) -> int | None:
        return self._graphs.bucket(num_rows)

    def forward(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One loaded bucket: (figures `[rows, 2 W + 2]`, hidden `[rows * W, hidden]`, logits `[rows * W, V]` in
        the LM head's dtype)."""
        w, decode = self.width, self.decode
        carry = self._carry[:rows]
        decode.windows(rows).copy_(carry[:, :w])
        accept_rows = decode.rows_to_accept(rows)
        live = accept_rows.widths > 0
        extra = torch.where(live, carry[:, w], 0)
        decode.shift_rows(rows, extra)
        hidden = decode.forward(rows)
        # the verify needs argmaxes and finiteness only: the LM head's own dtype gives both as fp32 would (a
        # widening cast is exact), in half the graph's memory
        logits = self.model.logits(hidden, fp32=False)
        limits = self._limits[:rows]
        counts, next_tokens, pairs, bad = verify_full_windows_on_device(
            logits, carry[:, 1:w], limits[:, 1], max_kept=limits[:, 0] - extra
        )
        self.state.accept(accept_rows, counts.to(torch.int32))
        self.draft.commit_on_device(rows, pairs, hidden, torch.where(live, counts, 0), extra)
        drafts, _ = self.draft.forward(rows, keep_logits=False)
        return self.figures.pack(next_tokens, drafts, counts, bad, pairs), hidden, logits

    def fill_hold(self, rows: int) -> None:
        """Every row a HOLD row (capture and warm-up change no state)."""
        self.decode.fill_hold(rows)
        self.draft.fill_hold(rows)
        self._carry.zero_()
        self._host_limits[:, 0] = 0
        self._host_limits[:, 1] = -1
        copy_to_device(self._limits, self._host_limits)

    def capture(self) -> None:
        """One graph per bucket; call after the decode and draft graphs. A failure leaves these steps eager. The
        graphs share the decode graphs' memory pool: the two never replay together, and each one's outputs are
        used (here: copied) before the next replay."""
        if self.use_graphs:
            self.use_graphs = self._graphs.capture(pool=self.decode.graph_pool())

    def load(
        self, n: int, windows: torch.Tensor, extra: torch.Tensor | None, room: np.ndarray, kept: np.ndarray | None
    ) -> None:
        """The step's own inputs for its first `n` rows (the decode and draft buffers loaded before): `windows
        [n, W]` and `extra [n]` on the device, `room [n]` and `kept [n]` from the host."""
        w = self.width
        self._carry[:n, :w].copy_(windows)
        if extra is None:
            self._carry[:n, w].zero_()
        else:
            self._carry[:n, w].copy_(extra)
        limits = self._host_limits
        limits[:n, 0] = room
        limits[:n, 1] = -1 if kept is None else kept
        copy_to_device(self._limits[:n], limits[:n])

    def run(self, rows: int, n: int, keep_logits: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Replay a loaded bucket; copies of the first `n` rows' figures and hidden states (and of their logits,
        fp32, when `keep_logits`), which stay valid after the next replay."""
        figures, hidden, logits = self._graphs.run(rows)
        w = self.width
        return (
            figures[:n].clone(),
            hidden[: n * w].clone(),
            logits[: n * w].to(torch.float32, copy=True) if keep_logits else None,
        )
