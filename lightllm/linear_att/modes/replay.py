"""Replay mode: canonical state + fp32 history records + cursor; verify folds on device when the window won't fit."""

from __future__ import annotations

import torch

from lightllm.linear_att.base import DecodeRows, LayerParams
from lightllm.linear_att.bundles import ReplayBuffers
from lightllm.linear_att.modes.common import StateCommon
from lightllm.linear_att.torch_ops.replay import replay_folds


class ReplayState(StateCommon):
    """`ssm [NL, S, HV, K, V]`, double-buffered `hist_k/u/g [NL, S, 2, L, ...]` (fp32), `cursor`, `parity [S]`."""

    def __init__(self, spec, config):
        super().__init__(spec, config)
        nl, ns, cap, dev = spec.num_layers, self.num_slots, config.replay_capacity, self.device
        hv, kd, vd = spec.num_v_heads, spec.head_k_dim, spec.head_v_dim
        self.replay_capacity = cap
        self.projection = config.projection
        self.ssm = torch.zeros(nl, ns, hv, kd, vd, dtype=config.state_dtype, device=dev)
        self.hist_k = torch.zeros(nl, ns, 2, cap, spec.num_k_heads, kd, dtype=torch.float32, device=dev)
        self.hist_u = torch.zeros(nl, ns, 2, cap, hv, vd, dtype=torch.float32, device=dev)
        self.hist_g = torch.zeros(nl, ns, 2, cap, hv, spec.gate_dim, dtype=torch.float32, device=dev)
        self.cursor = torch.zeros(ns, dtype=torch.int32, device=dev)
        self.parity = torch.zeros(ns, dtype=torch.int32, device=dev)
        # rows folded so far (one per row and step, all layers at once); on the device so accept never syncs
        self.num_folds = torch.zeros((), dtype=torch.int64, device=dev)
        # one bundle of fixed views per layer, built once: every decode launches on the same addresses
        self._layer_buffers = [self._buffers(layer) for layer in range(nl)]

    def _buffers(self, layers) -> ReplayBuffers:
        """The state of `layers` (an index: one layer; a slice: a stack of layers) as one bundle."""
        return ReplayBuffers(
            self.ssm[layers], self.hist_k[layers], self.hist_u[layers], self.hist_g[layers], self.cursor, self.parity
        )

    def decode(self, layer: int, rows: DecodeRows, mixed_qkv, graw, braw, params: LayerParams) -> torch.Tensor:
        widths, tokens = self._decode_inputs(layer, rows, mixed_qkv, graw, braw, params)
        return self.kernels.replay_verify(
            tokens, self._layer_buffers[layer], rows.slots, widths, projection=self.projection, backend=self.backend
        )

    def counters(self) -> dict[str, torch.Tensor]:
        return {"num_folds": self.num_folds}

    def accept(self, rows: DecodeRows, num_accepted: torch.Tensor) -> None:
        widths = self._live_widths(rows)
        # the verify kernels folded exactly the rows this predicate selects (README: one fold rule)
        folded = (widths > 0) & replay_folds(self.cursor[rows.slots.long()], widths, self.replay_capacity)
        self.num_folds += folded.sum()
        self.kernels.replay_accept(
            self.cursor,
            self.parity,
            self.conv_offset,
            rows.slots,
            widths,
            num_accepted,
            self.replay_capacity,
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
        self.ssm.index_fill_(1, slots, 0)
        self.cursor.index_fill_(0, slots, 0)
        self.parity.index_fill_(0, slots, 0)

    def _ssm_prefill_initial(self, layer, slots):
        # pending history must be in the canonical state before the chunk kernel reads it; the cursor is cleared
        # once for all layers in finish_prefill
        self.kernels.replay_fold(self._buffers(slice(layer, layer + 1)), slots, backend=self.backend)
        return self.ssm[layer, slots.long()]

    def _ssm_prefill_write(self, layer, slots, state):
        self.ssm[layer, slots.long()] = state.to(self.ssm.dtype)

    def _ssm_finish_prefill(self, slots):
        # index_fill_ takes its value as a scalar argument: capturable in the prefill graphs (a setitem of 0
        # would copy a host tensor)
        self.cursor.index_fill_(0, slots, 0)

    def _ssm_export(self, slots):
        out = torch.empty(
            self.ssm.shape[0], slots.numel(), *self.ssm.shape[2:], dtype=self.ssm.dtype, device=self.device
        )
        self.kernels.replay_fold(self._buffers(slice(None)), slots, out=out, backend=self.backend)
        return out

    def _ssm_import(self, slots, ssm):
        self.ssm[:, slots] = ssm.to(self.ssm.dtype)
        self.cursor.index_fill_(0, slots, 0)
        self.parity.index_fill_(0, slots, 0)
