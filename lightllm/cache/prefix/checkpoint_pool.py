"""Device storage for linear-attention checkpoints: a fixed number of slots, each one request's canonical state.

A slot holds what `LinearAttState.export_checkpoint` returns for one request (the accepted conv window and the
canonical SSM state of every linear layer) and, with an MTP head, the main model's final hidden state at the
checkpoint's last token (the MTP head drafts from it). Copies in and out are index operations on the device.
Slots are handed out LIFO: a fresh pool gives 0, 1, 2, ... and reuses freed slots in release order.
"""

from __future__ import annotations

import torch

from lightllm.linear_att.base import Checkpoint


class CheckpointPool:
    def __init__(
        self,
        template: Checkpoint,
        num_slots: int,
        hidden_size: int = 0,
        hidden_dtype: torch.dtype = torch.float32,
    ):
        """`template`: a one-request checkpoint giving shapes, dtypes and device; `hidden_size` 0 = no MTP."""
        conv, ssm = template.conv, template.ssm
        self.num_slots = num_slots
        self.device = conv.device
        self.conv = torch.zeros(conv.shape[0], num_slots, *conv.shape[2:], dtype=conv.dtype, device=self.device)
        self.ssm = torch.zeros(ssm.shape[0], num_slots, *ssm.shape[2:], dtype=ssm.dtype, device=self.device)
        self.hidden = (
            torch.zeros(num_slots, hidden_size, dtype=hidden_dtype, device=self.device) if hidden_size else None
        )
        self.bytes_per_checkpoint = self.bytes_per_slot(template, hidden_size, hidden_dtype)
        self._free = list(range(num_slots - 1, -1, -1))

    @staticmethod
    def bytes_per_slot(template: Checkpoint, hidden_size: int = 0, hidden_dtype: torch.dtype = torch.float32) -> int:
        """Bytes one checkpoint slot costs (conv window + SSM state of all layers + the MTP hidden state)."""
        hidden = hidden_size * torch.empty((), dtype=hidden_dtype).element_size()
        return sum(t.numel() // t.shape[1] * t.element_size() for t in (template.conv, template.ssm)) + hidden

    @property
    def num_bytes(self) -> int:
        tensors = [self.conv, self.ssm] + ([self.hidden] if self.hidden is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise RuntimeError("checkpoint pool full")
        return self._free.pop()

    def free(self, slot: int) -> None:
        assert slot not in self._free, f"double free of checkpoint slot {slot}"
        self._free.append(slot)

    def write(self, slot: int, checkpoint: Checkpoint, hidden: torch.Tensor | None = None) -> None:
        """Store a one-request checkpoint (and, with MTP, its `[1, hidden]` last hidden state) in `slot`."""
        self.conv[:, slot] = checkpoint.conv[:, 0]
        self.ssm[:, slot] = checkpoint.ssm[:, 0]
        if self.hidden is not None:
            assert hidden is not None, "this pool stores the MTP hidden state with every checkpoint"
            self.hidden[slot] = hidden.reshape(-1)

    def write_many(self, slots: torch.Tensor, checkpoint: Checkpoint, hidden: torch.Tensor | None = None) -> None:
        """Store checkpoint `i` of a batch (and, with MTP, its hidden state `hidden[i]`, `[N, hidden]`) in
        `slots[i]` (distinct slots, on the pool's device), one copy per tensor."""
        assert (hidden is None) == (self.hidden is None), "MTP hidden states go with every checkpoint, or none"
        self.conv.index_copy_(1, slots, checkpoint.conv.to(self.conv.dtype))
        self.ssm.index_copy_(1, slots, checkpoint.ssm.to(self.ssm.dtype))
        if hidden is not None:
            self.hidden.index_copy_(0, slots, hidden.to(self.hidden.dtype))

    def read(self, slot: int) -> tuple[Checkpoint, torch.Tensor | None]:
        """Views of `slot`: a one-request checkpoint and the `[1, hidden]` hidden state (None without MTP)."""
        ckpt = Checkpoint(conv=self.conv[:, slot : slot + 1], ssm=self.ssm[:, slot : slot + 1])
        return ckpt, None if self.hidden is None else self.hidden[slot : slot + 1]
