"""Compact mode: one state per request plus two raw `Wmax`-token windows; the accepted tokens are merged lazily.

`accept` only records how many tokens of the window just verified were accepted (`pending`) and flips `parity`
(which window buffer holds them); the slot's next `decode` merges them into `ssm` in the same kernel that verifies
the new window, so a step reads and writes the state once. Export merges them into the checkpoint copy; prefill
merges them per layer before the chunk kernel reads the state.
"""

from __future__ import annotations

import torch

from lightllm.linear_att.base import DecodeRows, LayerParams
from lightllm.linear_att.bundles import CompactBuffers
from lightllm.linear_att.modes.common import StateCommon


class CompactState(StateCommon):
    """`ssm [NL, S, HV, K, V]`, double-buffered fp32 records `win_k` (k̂), `win_u` (u), `win_g` (g)
    `[NL, S, 2, Wmax, ...]`, `pending`, `parity [S]` int32.

    The current state of a slot is `ssm` with the first `pending` records of window buffer `parity` applied.
    """

    def __init__(self, spec, config):
        super().__init__(spec, config)
        nl, ns, w, dev = spec.num_layers, self.num_slots, config.max_width, self.device
        hv, kd, vd = spec.num_v_heads, spec.head_k_dim, spec.head_v_dim
        self.ssm = torch.zeros(nl, ns, hv, kd, vd, dtype=config.state_dtype, device=dev)
        # per window token what the merge needs and the verify computed: k̂, u = β (v − Sᵀ k̂) and g, fp32
        self.win_k = torch.zeros(nl, ns, 2, w, spec.num_k_heads, kd, dtype=torch.float32, device=dev)
        self.win_u = torch.zeros(nl, ns, 2, w, hv, vd, dtype=torch.float32, device=dev)
        self.win_g = torch.zeros(nl, ns, 2, w, hv, spec.gate_dim, dtype=torch.float32, device=dev)
        self.pending = torch.zeros(ns, dtype=torch.int32, device=dev)
        self.parity = torch.zeros(ns, dtype=torch.int32, device=dev)

        # one bundle of fixed views per layer, built once: every decode launches on the same addresses
        self._layer_buffers = [self._buffers(layer) for layer in range(nl)]

    def _buffers(self, layers) -> CompactBuffers:
        """The state of `layers` (an index: one layer; a slice: a stack of layers) as one bundle."""
        return CompactBuffers(self.ssm[layers], *self._windows(layers), self.pending, self.parity)

    def _windows(self, layers=slice(None)):
        return self.win_k[layers], self.win_u[layers], self.win_g[layers]

    def decode(self, layer: int, rows: DecodeRows, mixed_qkv, graw, braw, params: LayerParams) -> torch.Tensor:
        widths, tokens = self._decode_inputs(layer, rows, mixed_qkv, graw, braw, params)
        return self.kernels.compact_verify(tokens, self._layer_buffers[layer], rows.slots, widths, backend=self.backend)

    def accept(self, rows: DecodeRows, num_accepted: torch.Tensor) -> None:
        widths = self._live_widths(rows)
        live = widths > 0
        accepted = num_accepted.to(torch.int32)
        # the verify just merged the old pending tokens and wrote its window into buffer 1 - parity
        self._set_live_slots(self.pending, rows, live, torch.minimum(accepted, widths))
        self._set_live_slots(self.parity, rows, live, 1 - self.parity[rows.slots.long()])
        self._set_live_slots(self.conv_offset, rows, live, accepted - 1)

    def _ssm_tensors(self):
        return [(self.ssm, 1), *((t, 1) for t in self._windows()), (self.pending, 0), (self.parity, 0)]

    def _ssm_reset(self, slots):
        self.ssm.index_fill_(1, slots, 0)
        self.pending.index_fill_(0, slots, 0)
        self.parity.index_fill_(0, slots, 0)

    def _ssm_prefill_initial(self, layer, slots):
        # the chunk kernel reads the merged state; pending is cleared once for all layers in finish_prefill
        self.kernels.compact_commit(self._buffers(slice(layer, layer + 1)), slots, backend=self.backend)
        return self.ssm[layer, slots.long()]

    def _ssm_prefill_write(self, layer, slots, state):
        self.ssm[layer, slots.long()] = state.to(self.ssm.dtype)

    def _ssm_finish_prefill(self, slots):
        # index_fill_ takes its value as a scalar argument: capturable in the prefill graphs (a setitem of 0
        # would copy a host tensor)
        self.pending.index_fill_(0, slots, 0)

    def _ssm_export(self, slots):
        # merge into gathered copies (rows 0..n-1) so the live state keeps its pending tokens and bytes
        copies = self._buffers(slice(None)).gathered(slots)
        rows = torch.arange(slots.numel(), dtype=torch.int32, device=self.device)
        self.kernels.compact_commit(copies, rows, backend=self.backend)
        return copies.ssm

    def _ssm_import(self, slots, ssm):
        self.ssm[:, slots] = ssm.to(self.ssm.dtype)
        self.pending.index_fill_(0, slots, 0)
        self.parity.index_fill_(0, slots, 0)
