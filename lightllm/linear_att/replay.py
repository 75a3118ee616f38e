"""Replay mode: canonical state + fp32 history records + cursor; verify folds on device when the window won't fit."""

from __future__ import annotations

import torch

from lightllm.linear_att import ops
from lightllm.linear_att.base import DecodeRows, LayerParams
from lightllm.linear_att.state_common import StateCommon


class ReplayState(StateCommon):
    """`ssm [NL, S, HV, K, V]`, double-buffered `hist_k/u/g [NL, S, 2, L, ...]` (fp32), `cursor`, `parity [S]`."""

    def __init__(self, spec, config):
        super().__init__(spec, config)
        nl, ns, cap, dev = spec.num_layers, self.num_slots, config.replay_capacity, self.device
        hv, kd, vd = spec.num_v_heads, spec.head_k_dim, spec.head_v_dim
        self.capacity = cap
        self.projection = config.projection
        self.ssm = torch.zeros(nl, ns, hv, kd, vd, dtype=config.state_dtype, device=dev)
        self.hist_k = torch.zeros(nl, ns, 2, cap, spec.num_k_heads, kd, dtype=torch.float32, device=dev)
        self.hist_u = torch.zeros(nl, ns, 2, cap, hv, vd, dtype=torch.float32, device=dev)
        self.hist_g = torch.zeros(nl, ns, 2, cap, hv, spec.gate_dim, dtype=torch.float32, device=dev)
        self.cursor = torch.zeros(ns, dtype=torch.int32, device=dev)
        self.parity = torch.zeros(ns, dtype=torch.int32, device=dev)
        # rows folded so far (one per row and step, all layers at once); on the device so accept never syncs
        self.num_folds = torch.zeros((), dtype=torch.int64, device=dev)

    def decode(self, layer: int, rows: DecodeRows, mixed_qkv, graw, braw, params: LayerParams) -> torch.Tensor:
        widths, q, k, v = self._decode_inputs(layer, rows, mixed_qkv, params)
        return ops.replay_verify(
            q,
            k,
            v,
            graw,
            braw,
            params.A_log,
            params.dt_bias,
            self.ssm[layer],
            self.hist_k[layer],
            self.hist_u[layer],
            self.hist_g[layer],
            self.cursor,
            self.parity,
            rows.slots,
            widths,
            projection=self.projection,
            lower_bound=self.spec.gate_lower_bound,
            backend=self.backend,
        )

    def accept(self, rows: DecodeRows, num_accepted: torch.Tensor) -> None:
        widths = self._live_widths(rows)
        # the verify kernels folded exactly the rows this predicate selects (README: one fold rule)
        folded = (widths > 0) & (self.cursor[rows.slots.long()] + widths > self.capacity)
        self.num_folds += folded.sum()
        ops.replay_accept(
            self.cursor,
            self.parity,
            self.conv_offset,
            rows.slots,
            widths,
            num_accepted,
            self.capacity,
            backend=self.backend,
        )

    def _ssm_tensors(self):
        return [
            (self.ssm, 1),
            (self.hist_k, 1),
            (self.hist_u, 1),
            (self.hist_g, 1),
            (self.cursor, 0),
            (self.parity, 0),
        ]

    def _ssm_reset(self, slots):
        self.ssm[:, slots] = 0
        self.cursor[slots] = 0
        self.parity[slots] = 0

    def _layer_view(self, layer):
        sel = slice(layer, layer + 1)
        return self.ssm[sel], self.hist_k[sel], self.hist_u[sel], self.hist_g[sel]

    def _ssm_prefill_initial(self, layer, slots):
        # pending history must be in the canonical state before the chunk kernel reads it; the cursor is cleared
        # once for all layers in finish_prefill
        ops.replay_fold(*self._layer_view(layer), self.cursor, self.parity, slots, backend=self.backend)
        return self.ssm[layer, slots.long()]

    def _ssm_prefill_write(self, layer, slots, state):
        self.ssm[layer, slots.long()] = state.to(self.ssm.dtype)

    def _ssm_finish_prefill(self, slots):
        self.cursor[slots] = 0

    def _ssm_export(self, slots):
        out = torch.empty(
            self.ssm.shape[0], slots.numel(), *self.ssm.shape[2:], dtype=self.ssm.dtype, device=self.device
        )
        ops.replay_fold(
            self.ssm,
            self.hist_k,
            self.hist_u,
            self.hist_g,
            self.cursor,
            self.parity,
            slots,
            out=out,
            backend=self.backend,
        )
        return out

    def _ssm_import(self, slots, ssm):
        self.ssm[:, slots] = ssm.to(self.ssm.dtype)
        self.cursor[slots] = 0
        self.parity[slots] = 0
