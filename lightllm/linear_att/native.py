"""Native mode: `Wmax` full states per request; verify writes the state after every window token."""

from __future__ import annotations

import torch

from lightllm.linear_att import ops
from lightllm.linear_att.base import DecodeRows, LayerParams
from lightllm.linear_att.state_common import StateCommon


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

    def decode(self, layer: int, rows: DecodeRows, mixed_qkv, graw, braw, params: LayerParams) -> torch.Tensor:
        widths, q, k, v = self._decode_inputs(layer, rows, mixed_qkv, params)
        return ops.native_verify(
            q,
            k,
            v,
            graw,
            braw,
            params.A_log,
            params.dt_bias,
            self.ssm[layer],
            self.ssm_index,
            rows.slots,
            widths,
            lower_bound=self.spec.gate_lower_bound,
            backend=self.backend,
        )

    def accept(self, rows: DecodeRows, num_accepted: torch.Tensor) -> None:
        live = self._live_widths(rows) > 0
        last = num_accepted.to(torch.int32) - 1
        self._set_live_slots(self.ssm_index, rows, live, last)
        self._set_live_slots(self.conv_offset, rows, live, last)

    def _ssm_tensors(self):
        return [(self.ssm, 1), (self.ssm_index, 0)]

    def _ssm_reset(self, slots):
        self.ssm[:, slots] = 0
        self.ssm_index[slots] = 0

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
        self.ssm[:, slots] = 0
        self.ssm[:, slots, 0] = ssm.to(self.ssm.dtype)
        self.ssm_index[slots] = 0
