"""Native mode: `Wmax` full states per request; verify writes the state after every window token."""

from __future__ import annotations

import torch

from lightllm.linear_att.base import DecodeRows, LayerParams
from lightllm.linear_att.bundles import NativeBuffers
from lightllm.linear_att.modes.common import StateCommon


class NativeState(StateCommon):
    """`ssm [NL, S, Wmax, HV, K, V]`, `ssm_index [S]`: slot `ssm_index` of a request holds its current state."""

    def __init__(self, spec, config):
        super().__init__(spec, config)
        self.ssm = torch.zeros(
            spec.num_layers,
            self.num_slots,
            config.max_width,
            spec.num_v_heads,
            spec.head_k_dim,
            spec.head_v_dim,
            dtype=config.state_dtype,
            device=self.device,
        )
        self.ssm_index = torch.zeros(self.num_slots, dtype=torch.int32, device=self.device)
        # one bundle of fixed views per layer, built once: every decode launches on the same addresses
        self._layer_buffers = [NativeBuffers(self.ssm[layer], self.ssm_index) for layer in range(spec.num_layers)]

    def decode(self, layer: int, rows: DecodeRows, mixed_qkv, graw, braw, params: LayerParams) -> torch.Tensor:
        widths, tokens = self._decode_inputs(layer, rows, mixed_qkv, graw, braw, params)
        return self.kernels.native_verify(tokens, self._layer_buffers[layer], rows.slots, widths, backend=self.backend)

    def accept(self, rows: DecodeRows, num_accepted: torch.Tensor) -> None:
        self.kernels.native_accept(
            self.ssm_index, self.conv_offset, rows.slots, self._live_widths(rows), num_accepted, backend=self.backend
        )

    def _ssm_tensors(self):
        return [(self.ssm, 1), (self.ssm_index, 0)]

    def _ssm_reset(self, slots):
        self.ssm.index_fill_(1, slots, 0)
        self.ssm_index.index_fill_(0, slots, 0)

    def _current(self, slots):
        return self.ssm_index[slots].long()

    def _ssm_prefill_initial(self, layer, slots):
        sl = slots.long()
        return self.ssm[layer, sl, self._current(sl)]

    def _ssm_prefill_write(self, layer, slots, state):
        sl = slots.long()
        self.ssm[layer, sl, self._current(sl)] = state.to(self.ssm.dtype)

    def _ssm_export(self, slots):
        return self.ssm[:, slots, self._current(slots)].clone()

    def _ssm_import(self, slots, ssm):
        self.ssm.index_fill_(1, slots, 0)
        self.ssm[:, slots, 0] = ssm.to(self.ssm.dtype)
        self.ssm_index.index_fill_(0, slots, 0)
