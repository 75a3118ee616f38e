"""What every state mode shares: slots, the conv window, the prefill path and the checkpoint conv part.

A mode subclass owns its SSM tensors and implements the `_ssm_*` hooks; it never re-implements conv or
slot bookkeeping. Storage layouts are those of README.md in this package.
"""

from __future__ import annotations

import torch

from lightllm.linear_att import ops
from lightllm.linear_att.base import Checkpoint, DecodeRows, LayerParams, PrefillRows
from lightllm.linear_att.bundles import TokenInputs
from lightllm.linear_att.modes.slots import SlotAllocator


class StateCommon:
    """Conv window + slots + prefill for all layers; subclasses add the SSM storage of their mode, and the
    state classes of `states.py` bind a mode to an `Algorithm` descriptor (`algorithm`)."""

    # bound in `states.py`: the `Algorithm` descriptor and its operator entry points (`Algorithm.kernels`)
    algorithm = None
    kernels = None

    def __init__(self, spec, config):
        if self.algorithm is not None and spec.algo != self.algorithm.name:
            raise ValueError(f"{type(self).__name__} holds {self.algorithm.name} state, the spec is {spec.algo!r}")
        self.spec = spec
        self.config = config
        self._slots = SlotAllocator(config.max_requests)
        self.num_slots = self._slots.num_slots
        self.hold_slot = self._slots.hold_slot
        self.max_width = config.max_width
        self.device = torch.device(config.device)
        self.backend = config.backend
        self.conv_hist_len = spec.conv_kernel_size - 1
        conv_cols = self.conv_hist_len + config.max_width - 1
        self.conv = torch.zeros(
            spec.num_layers, self.num_slots, spec.conv_dim, conv_cols, dtype=config.act_dtype, device=self.device
        )
        self.conv_offset = torch.zeros(self.num_slots, dtype=torch.int32, device=self.device)

    # slots -----------------------------------------------------------------------------------------------
    def alloc(self) -> int:
        slot = self._slots.alloc()
        # a fill, not a copy from host memory: admitting a request does not wait for the device
        self.reset(torch.full((1,), slot, dtype=torch.int32, device=self.device))
        return slot

    def free(self, slot: int) -> None:
        self._slots.free(slot)

    def num_free_slots(self) -> int:
        return self._slots.num_free()

    def reset(self, slots: torch.Tensor) -> None:
        # index_fill_ takes its value as a scalar argument: a setitem of 0 copies a host tensor, which waits for
        # the device (admitting a request would stall the host behind the running step)
        sl = slots.long()
        self.conv.index_fill_(1, sl, 0)
        self.conv_offset.index_fill_(0, sl, 0)
        self._ssm_reset(sl)

    def counters(self) -> dict[str, torch.Tensor]:
        return {}

    def bytes_per_request(self) -> int:
        """Exact: every per-slot tensor's bytes divided by its slot count (conv, SSM, history / scratch, scalars)."""
        total = 0
        for tensor, slot_dim in self._per_slot_tensors():
            total += tensor.numel() * tensor.element_size() // tensor.shape[slot_dim]
        return total

    def _per_slot_tensors(self) -> list[tuple[torch.Tensor, int]]:
        return [(self.conv, 1), (self.conv_offset, 0)] + self._ssm_tensors()

    # helpers ---------------------------------------------------------------------------------------------
    def _live_widths(self, rows: DecodeRows) -> torch.Tensor:
        """Row widths with the HOLD slot forced to 0 (it must never be written); computed by the first layer of the
        step and reused by the others (the same rows every layer)."""
        key = ("live_widths", self.hold_slot)
        if key not in rows.derived:
            widths = rows.widths.to(torch.int32)
            rows.derived[key] = torch.where(rows.slots == self.hold_slot, torch.zeros_like(widths), widths)
        return rows.derived[key]

    def _set_live_slots(self, target: torch.Tensor, rows: DecodeRows, live: torch.Tensor, value: torch.Tensor) -> None:
        """`target[slots[i]] = value[i]` for rows with `live[i]`, without a host sync (CUDA-graph safe).

        A boolean-mask selection would sync on its data-dependent size; instead every row writes, and a dead row
        is pointed at the HOLD slot with the HOLD slot's own value, so its bytes stay unchanged and it never races
        a live row (live rows never use the HOLD slot; `_live_widths` makes it width 0).
        """
        hold = torch.full_like(rows.slots, self.hold_slot).long()
        index = torch.where(live, rows.slots.long(), hold)
        target[index] = torch.where(live, value.to(target.dtype), target[hold])

    def _split_qkv(self, y: torch.Tensor):
        s = self.spec
        key_dim = s.num_k_heads * s.head_k_dim
        q, k, v = torch.split(y, [key_dim, key_dim, s.num_v_heads * s.head_v_dim], dim=-1)
        lead = y.shape[:-1]
        return (
            q.reshape(*lead, s.num_k_heads, s.head_k_dim),
            k.reshape(*lead, s.num_k_heads, s.head_k_dim),
            v.reshape(*lead, s.num_v_heads, s.head_v_dim),
        )

    def _decode_inputs(self, layer: int, rows: DecodeRows, mixed_qkv, graw, braw, params: LayerParams):
        """(live widths, `TokenInputs`) of one layer's decode rows: the conv window step, then q / k / v."""
        widths = self._live_widths(rows)
        y = ops.causal_conv_decode(
            mixed_qkv,
            self.conv[layer],
            self.conv_offset,
            rows.slots,
            widths,
            params.conv_weight,
            params.conv_bias,
            backend=self.backend,
        )
        q, k, v = self._split_qkv(y)
        lower_bound = self.spec.gate_lower_bound
        return widths, TokenInputs(q, k, v, graw, braw, params.A_log, params.dt_bias, lower_bound=lower_bound)

    # prefill ---------------------------------------------------------------------------------------------
    def prefill(
        self,
        layer: int,
        rows: PrefillRows,
        mixed_qkv: torch.Tensor,
        graw: torch.Tensor,
        braw: torch.Tensor,
        params: LayerParams,
    ) -> torch.Tensor:
        """See `LinearAttState.prefill`."""
        y = ops.causal_conv_prefill(
            mixed_qkv,
            self.conv[layer],
            self.conv_offset,
            rows.slots,
            rows.cu_seqlens,
            params.conv_weight,
            params.conv_bias,
            rows.has_initial_state,
            backend=self.backend,
        )
        g, beta = ops.activate_gates(graw, braw, params.A_log, params.dt_bias, self.spec.gate_lower_bound)
        valid = rows.padded_valid
        if valid is not None:
            # padding tokens: finite inputs (their conv output is unspecified), no decay (g = 0) and no update
            # (beta = 0), so the state after the last token is the state after the last real one
            y = torch.where(valid[:, None], y, torch.zeros_like(y))
            g = torch.where(valid[:, None, None], g, torch.zeros_like(g))
            beta = torch.where(valid[:, None], beta, torch.zeros_like(beta))
        q, k, v = self._split_qkv(y)
        current = self._ssm_prefill_initial(layer, rows.slots).float()
        init = torch.where(
            rows.has_initial_state.to(torch.bool)[:, None, None, None], current, torch.zeros_like(current)
        )
        # prefill follows the device (fla on CUDA, torch on CPU) even when tests force the Triton decode kernels
        # a padded row runs as one sequence of all its tokens, without offsets a CUDA graph could not read
        cu_seqlens = None if valid is not None else rows.chunk_cu_seqlens
        o, final = ops.chunk_delta_rule(
            q,
            k,
            v,
            g,
            beta,
            init,
            cu_seqlens,
            algorithm=self.spec.algorithm,
            chunk_indices=rows.chunk_indices,
            cu_seqlens_cpu=rows.cu_seqlens_cpu,
        )
        if valid is not None:
            # one row with at least one real token: no data-dependent selection (a host sync) needed
            self._ssm_prefill_write(layer, rows.slots, final)
            return o
        # a row without tokens keeps its state: it is written back as it was, since selecting the other rows by a
        # mask would wait for the device in every layer (no launches queued ahead meanwhile)
        live = (rows.cu_seqlens[1:] - rows.cu_seqlens[:-1]) > 0
        self._ssm_prefill_write(layer, rows.slots, torch.where(live[:, None, None, None], final, current))
        return o

    def finish_prefill(self, slots: torch.Tensor) -> None:
        self._ssm_finish_prefill(slots.long())

    # checkpoints -----------------------------------------------------------------------------------------
    def export_checkpoint(self, slots: torch.Tensor) -> Checkpoint:
        sl = slots.long()
        cols = self.conv_offset[sl].long()[:, None] + torch.arange(self.conv_hist_len, device=self.device)
        window = self.conv[:, sl]  # [NL, n, C, Kc - 1 + Wmax - 1]
        conv = torch.gather(window, 3, cols[None, :, None, :].expand(*window.shape[:3], self.conv_hist_len))
        return Checkpoint(conv=conv, ssm=self._ssm_export(sl))

    def import_checkpoint(self, slots: torch.Tensor, checkpoint: Checkpoint) -> None:
        sl = slots.long()
        self.conv.index_fill_(1, sl, 0)
        self.conv[:, sl, :, : self.conv_hist_len] = checkpoint.conv.to(self.conv.dtype)
        self.conv_offset.index_fill_(0, sl, 0)
        self._ssm_import(sl, checkpoint.ssm)

    # hooks -----------------------------------------------------------------------------------------------
    def _ssm_tensors(self) -> list[tuple[torch.Tensor, int]]:
        raise NotImplementedError

    def _ssm_reset(self, slots: torch.Tensor) -> None:
        raise NotImplementedError

    def _ssm_prefill_initial(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _ssm_prefill_write(self, layer: int, slots: torch.Tensor, state: torch.Tensor) -> None:
        raise NotImplementedError

    def _ssm_finish_prefill(self, slots: torch.Tensor) -> None:
        pass

    def _ssm_export(self, slots: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _ssm_import(self, slots: torch.Tensor, ssm: torch.Tensor) -> None:
        raise NotImplementedError
