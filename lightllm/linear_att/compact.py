"""Compact mode: one state per request plus a raw `Wmax`-token window; the state is written once, at accept."""

from __future__ import annotations

import torch

from lightllm.linear_att import ops
from lightllm.linear_att.base import DecodeRows, LayerParams
from lightllm.linear_att.state_common import StateCommon


class CompactState(StateCommon):
    """`ssm [NL, S, HV, K, V]` plus `win_k`, `win_v` (activation dtype) and `win_g`, `win_beta` (fp32)."""

    def __init__(self, spec, config):
        super().__init__(spec, config)
        nl, ns, w, dev = spec.num_layers, self.num_slots, config.max_width, self.device
        hv, kd, vd = spec.num_v_heads, spec.head_k_dim, spec.head_v_dim
        self.ssm = torch.zeros(nl, ns, hv, kd, vd, dtype=config.state_dtype, device=dev)
        self.win_k = torch.zeros(nl, ns, w, spec.num_k_heads, kd, dtype=config.act_dtype, device=dev)
        self.win_v = torch.zeros(nl, ns, w, hv, vd, dtype=config.act_dtype, device=dev)
        self.win_g = torch.zeros(nl, ns, w, hv, spec.gate_dim, dtype=torch.float32, device=dev)
        self.win_beta = torch.zeros(nl, ns, w, hv, dtype=torch.float32, device=dev)
        self._last_widths: torch.Tensor | None = None

    def decode(self, layer: int, rows: DecodeRows, mixed_qkv, graw, braw, params: LayerParams) -> torch.Tensor:
        widths, q, k, v = self._decode_inputs(layer, rows, mixed_qkv, params)
        return ops.compact_verify(
            q,
            k.to(self.win_k.dtype),
            v.to(self.win_v.dtype),
            graw,
            braw,
            params.A_log,
            params.dt_bias,
            self.ssm[layer],
            self.win_k[layer],
            self.win_v[layer],
            self.win_g[layer],
            self.win_beta[layer],
            rows.slots,
            widths,
            lower_bound=self.spec.gate_lower_bound,
            backend=self.backend,
        )

    def accept(self, rows: DecodeRows, num_accepted: torch.Tensor) -> None:
        widths = self._live_widths(rows)
        ops.compact_commit(
            self.ssm,
            self.win_k,
            self.win_v,
            self.win_g,
            self.win_beta,
            rows.slots,
            widths,
            num_accepted,
            backend=self.backend,
        )
        self._set_live_slots(self.conv_offset, rows, widths > 0, num_accepted.to(torch.int32) - 1)

    def _ssm_tensors(self):
        return [(self.ssm, 1), (self.win_k, 1), (self.win_v, 1), (self.win_g, 1), (self.win_beta, 1)]

    def _ssm_reset(self, slots):
        self.ssm[:, slots] = 0

    def _ssm_prefill_initial(self, layer, slots):
        return self.ssm[layer, slots.long()]

    def _ssm_prefill_write(self, layer, slots, state):
        self.ssm[layer, slots.long()] = state.to(self.ssm.dtype)

    def _ssm_export(self, slots):
        return self.ssm[:, slots].clone()

    def _ssm_import(self, slots, ssm):
        self.ssm[:, slots] = ssm.to(self.ssm.dtype)
