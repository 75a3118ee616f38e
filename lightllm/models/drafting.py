"""MTP drafting: commit the pending (main hidden, next token) pairs into the MTP head's KV, then chain drafts.

The head's KV holds one entry per committed pair (h_{t-1}, x_t) at position t, computed from the main model's
hidden state: exactly what a full pass of the head over the accepted sequence would hold. Chained draft steps
(the head's own output as hidden, its own draft as token) append temporary entries that the next `draft`
truncates before committing the pairs accepted in the meantime.
"""

from __future__ import annotations

import numpy as np
import torch

from lightllm.engine.kv_cache import KVCache
from lightllm.models.context import build_context


class MtpDrafter:
    def __init__(self, model, kv: KVCache):
        self.model = model
        self.head = model.mtp
        self.kv = kv

    def draft(self, handles: list[int], reqs: list, next_tokens: list[int], num_steps: int):
        """Returns (draft tokens `[N, num_steps]` int64, logits `[N, num_steps, vocab]` fp32)."""
        device = self.kv.device
        hidden, tokens, q_lens, cached = [], [], [], []
        for h, req, nxt in zip(handles, reqs, next_tokens):
            if not req.mtp_hidden:
                raise RuntimeError(f"request {h}: nothing to draft from (no forward since the last draft)")
            hid = torch.cat(req.mtp_hidden)
            ids = req.mtp_next_ids + [nxt]
            assert hid.shape[0] == len(ids), "MTP bookkeeping out of sync"
            hidden.append(hid)
            tokens += ids
            q_lens.append(len(ids))
            cached.append(req.mtp_len)
        rows = np.asarray(handles)
        self.kv.truncate_many(rows, np.asarray(cached))
        self.kv.extend_many(rows, np.asarray(q_lens))
        # every row is its own attention group: committing a prompt's pairs is a prefill of the head
        ctx = build_context(q_lens, cached, len(handles), handles, self.kv, position_offset=1)
        ids = torch.tensor(tokens, dtype=torch.int64, device=device)
        out = self.head(self.model.embed_tokens(ids), torch.cat(hidden), ctx)
        last = out[torch.tensor(q_lens, device=device).cumsum(0) - 1]
        for req, q in zip(reqs, q_lens):
            req.mtp_len += q
            req.mtp_hidden, req.mtp_next_ids = [], []
        all_logits = [self.model.logits(last)]
        drafts = [all_logits[-1].argmax(-1)]
        for step in range(1, num_steps):
            self.kv.extend_many(rows, np.ones(len(handles), dtype=np.int64))
            lens = [req.mtp_len + step - 1 for req in reqs]
            ctx = build_context([1] * len(handles), lens, 0, handles, self.kv, position_offset=1)
            last = self.head(self.model.embed_tokens(drafts[-1]), last, ctx)
            all_logits.append(self.model.logits(last))
            drafts.append(all_logits[-1].argmax(-1))
        return torch.stack(drafts, dim=1), torch.stack(all_logits, dim=1)
