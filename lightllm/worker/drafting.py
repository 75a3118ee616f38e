"""MTP drafting: commit the pending (main hidden, next token) pairs into the MTP head's KV, then chain drafts.

The head's KV holds one entry per committed pair (h_{t-1}, x_t) at position t, computed from the main model's
hidden state: exactly what a full pass of the head over the accepted sequence would hold. Chained draft steps
(the head's own output as hidden, its own draft as token) append temporary entries that the next `draft`
truncates before committing the pairs accepted in the meantime.
"""

from __future__ import annotations

import numpy as np
import torch

from lightllm.cache.device_copy import to_device
from lightllm.cache.kv_cache import KVCache, ragged_arange
from lightllm.models.context import build_context, padded_decode_width, padded_token_index
from lightllm.worker.graphs.draft import DraftGraphs


class MtpDrafter:
    def __init__(self, model, kv: KVCache, max_width: int):
        self.model = model
        self.head = model.mtp
        self.kv = kv
        # rows committing at most this many pairs run as one padded attention group (decode-like); longer ones
        # (a prompt's pairs after prefill) each run as their own group
        self.max_width = max_width
        # fixed-buffer (CUDA graph) drafting of batches whose rows all commit at most max_width pairs
        self.graphs: DraftGraphs | None = None

    def draft(self, handles: list[int], reqs: list, next_tokens: list[int], mtp_step: int):
        """Returns (draft tokens `[N, mtp_step]` int64, logits `[N, mtp_step, vocab]` fp32)."""
        device = self.kv.device
        for h, req in zip(handles, reqs):
            if not req.mtp_hidden:
                raise RuntimeError(f"request {h}: nothing to draft from (no forward since the last draft)")
        q = np.asarray([sum(n for _, _, n in req.mtp_hidden) for req in reqs], dtype=np.int64)
        for req, n in zip(reqs, q.tolist()):
            assert sum(c for _, _, c in req.mtp_next_ids) + 1 == n, "MTP bookkeeping out of sync"
        # prompt-length rows first (each its own attention group), then the short rows as one padded group
        order = np.argsort(q <= self.max_width, kind="stable")
        num_long = int((q > self.max_width).sum())
        reqs = [reqs[i] for i in order]
        q_lens = q[order]
        rows = np.asarray(handles)[order]
        cached = np.asarray([req.mtp_len for req in reqs], dtype=np.int64)
        # each row's pairs: the tokens after its pending hidden states (on the device), then its next token
        next_dev = to_device(np.asarray(next_tokens, dtype=np.int64)[order], device)
        tokens = gather_spans([[*req.mtp_next_ids, (next_dev, i, 1)] for i, req in enumerate(reqs)], device)
        hidden = gather_spans([req.mtp_hidden for req in reqs], device)
        inverse = torch.from_numpy(np.argsort(order)).to(device)
        graphs = self.graphs
        if num_long == 0 and graphs is not None and graphs.mtp_step == mtp_step and graphs.bucket(len(rows)):
            drafts, logits = graphs.run(rows, q_lens, cached, tokens, hidden)
            self._committed(reqs, q_lens, hidden)
            return drafts[inverse], logits[inverse]
        self.kv.truncate_many(rows, cached)
        self.kv.extend_many(rows, q_lens)
        ctx = build_context(q_lens.tolist(), cached.tolist(), num_long, rows.tolist(), self.kv, position_offset=1)
        width = padded_decode_width(q_lens.tolist(), num_long, 0)
        layout = torch.from_numpy(padded_token_index(q_lens.tolist(), num_long, width)).to(device)
        ids = torch.zeros(ctx.num_tokens, dtype=torch.int64, device=device)
        ids[layout] = tokens
        padded_hidden = hidden.new_zeros(ctx.num_tokens, hidden.shape[1])
        padded_hidden[layout] = hidden
        out = self.head(self.model.embed_tokens(ids), padded_hidden, ctx)
        last = out[layout[torch.from_numpy(np.cumsum(q_lens) - 1).to(device)]]
        self._committed(reqs, q_lens, hidden)
        all_logits = [self.model.logits(last)]
        drafts = [all_logits[-1].argmax(-1)]
        for step in range(1, mtp_step):
            self.kv.extend_many(rows, np.ones(len(rows), dtype=np.int64))
            ctx = build_context(
                [1] * len(rows), (cached + q_lens + step - 1).tolist(), 0, rows.tolist(), self.kv, position_offset=1
            )
            last = self.head(self.model.embed_tokens(drafts[-1]), last, ctx)
            all_logits.append(self.model.logits(last))
            drafts.append(all_logits[-1].argmax(-1))
        # back to the callers' row order
        return torch.stack(drafts, dim=1)[inverse], torch.stack(all_logits, dim=1)[inverse]

    @staticmethod
    def _committed(reqs: list, q_lens: np.ndarray, hidden: torch.Tensor) -> None:
        """The rows' pending pairs are in the head's KV now."""
        for req, n, end in zip(reqs, q_lens.tolist(), np.cumsum(q_lens).tolist()):
            req.mtp_len += n
            req.mtp_hidden, req.mtp_next_ids = [], []
            # the prefix cache checkpoints the hidden state of the last committed token
            req.mtp_last_hidden = (hidden, end - 1)

    def commit_known_pairs(self, handles: list[int], reqs: list) -> None:
        """Commit the requests' pending pairs whose next token is known (every pending hidden row but the last)
        into the head's KV without drafting, so the head's KV holds the pair of every committed token (the prefix
        cache shares it): one pass of the head, each row its own attention group. The last hidden row stays
        pending for the next `draft`, which commits the same entries a single `draft` would have."""
        known = [sum(count for _, _, count in req.mtp_next_ids) for req in reqs]
        todo = [i for i, n in enumerate(known) if n]
        if not todo:
            return
        device = self.kv.device
        handles, reqs = [handles[i] for i in todo], [reqs[i] for i in todo]
        q_lens = np.asarray([known[i] for i in todo], dtype=np.int64)
        pending = np.asarray([sum(count for _, _, count in req.mtp_hidden) for req in reqs], dtype=np.int64)
        # every row's pending hidden rows, back to back; the head reads each row's first `known` of them
        hidden = gather_spans([req.mtp_hidden for req in reqs], device)
        starts = np.cumsum(pending) - pending
        rows_in = to_device(ragged_arange(starts, q_lens), device)
        rows, cached = np.asarray(handles), np.asarray([req.mtp_len for req in reqs], dtype=np.int64)
        self.kv.truncate_many(rows, cached)
        self.kv.extend_many(rows, q_lens)
        ctx = build_context(q_lens.tolist(), cached.tolist(), len(rows), rows.tolist(), self.kv, position_offset=1)
        ids = gather_spans([req.mtp_next_ids for req in reqs], device)
        self.head(self.model.embed_tokens(ids), hidden[rows_in], ctx)
        for req, n, start, total in zip(reqs, q_lens.tolist(), starts.tolist(), pending.tolist()):
            req.mtp_len += n
            req.mtp_hidden, req.mtp_next_ids = [(hidden, start + n, total - n)], []


def gather_spans(spans_per_row: list[list[tuple[torch.Tensor, int, int]]], device) -> torch.Tensor:
    """Rows `(source, start, count)` of some step outputs (hidden states, or token ids), concatenated in order
    with one gather (the spans of a step usually all point into that step's one tensor)."""
    sources: dict[int, tuple[torch.Tensor, int]] = {}
    starts, counts = [], []
    for spans in spans_per_row:
        for src, start, count in spans:
            if id(src) not in sources:
                sources[id(src)] = (src, sum(t.shape[0] for t, _ in sources.values()))
            starts.append(sources[id(src)][1] + start)
            counts.append(count)
    tensors = [t for t, _ in sources.values()]
    table = tensors[0] if len(tensors) == 1 else torch.cat(tensors)
    index = ragged_arange(np.asarray(starts, dtype=np.int64), np.asarray(counts, dtype=np.int64))
    return table[torch.from_numpy(index).to(device, non_blocking=True)]


def drop_last_rows(spans: list[tuple[torch.Tensor, int, int]], num_rows: int) -> None:
    """Shorten `spans` (in place) by their last `num_rows` rows: a verify window's rejected positions."""
    while num_rows:
        source, start, count = spans[-1]
        if count > num_rows:
            spans[-1] = (source, start, count - num_rows)
            return
        spans.pop()
        num_rows -= count
