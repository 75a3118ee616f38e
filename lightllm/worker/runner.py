"""ModelRunner: the engine's handle on a model — weights, KV cache, linear-attention state, one forward per step.

Implements `lightllm.engine.batch.ModelRunnerProtocol`. The runner never branches on the state mode: it creates
the state through `create_state` and calls the protocol (prefill/decode inside the layers, then `accept` and
`finish_prefill` once per step).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np
import torch

from lightllm.cache.device_copy import to_device
from lightllm.cache.kv_cache import KVCache
from lightllm.cache.payload import RequestState, TensorBlob
from lightllm.cache.prefix.namespace import DEFAULT_NAMESPACE
from lightllm.engine.batch import ForwardBatch, ForwardOutput
from lightllm.engine.speculative.device_drafts import write_window_drafts
from lightllm.linear_att import StateConfig, StateMode, create_state
from lightllm.linear_att.base import DecodeRows
from lightllm.models.context import build_context, padded_decode_width, padded_token_index
from lightllm.models.dummy_weights import load_dummy_weights
from lightllm.models.hybrid import HybridModel
from lightllm.models.loader import load_weights
from lightllm.models.registry import load_model_config
from lightllm.models.tp import TPInfo
from lightllm.worker.config import RunnerConfig
from lightllm.worker.counter_copy import CounterCopy
from lightllm.worker.device_accept import DeviceAcceptance, HeldCheckpoint, UnsettledStep
from lightllm.worker.drafting import MtpDrafter, drop_last_rows
from lightllm.worker.graphs.decode import DecodeGraphs
from lightllm.worker.graphs.draft import DraftGraphs
from lightllm.worker.graphs.prefill import PrefillGraphs
from lightllm.worker.graphs.spec_step import SpecStepGraphs
from lightllm.worker.kv_sizing import (
    MemoryProbe,
    fitted_request_slots,
    kv_bytes_per_token,
    kv_row_lengths,
    memory_probe_of,
    mtp_extra_tokens,
    runner_kv_tokens,
)
from lightllm.worker.prefix_calls import PrefixCacheCalls
from lightllm.worker.records import PendingVerify, RequestRecord
from lightllm.worker.startup_phases import StartupPhases
from lightllm.worker.transfer.host_tier import RunnerHostTier
from lightllm.worker.transfer.prefix import RunnerPrefixCache, create_prefix_cache
from lightllm.worker.transfer.request_state import export_request, host_blobs, import_request
from lightllm.worker.warmup_steps import pin_fla, warm_attention_kernels, warm_up

logger = logging.getLogger(__name__)

# prefill rows of one step that replay the prefill graph one after another; more run as one eager forward: each
# replay reads every weight again, while an eager forward's host launches cost about the GPU time of a few replays
GRAPHED_PREFILL_ROWS = 4


class ModelRunner(DeviceAcceptance, PrefixCacheCalls):
    """Weights, linear-attention state and KV cache of one model (one TP rank), allocated in that order.

    With `config.max_total_token_num=None` the KV cache is sized after weights and state are in memory: from
    `memory_probe` (default on CUDA: the device's free, total and own bytes) within this process's share
    `config.mem_fraction` of the device, or on CPU
    without a probe to every request slot at full length (capped). Raises ValueError when not even one
    `max_req_total_len`-token request fits.
    """

    def __init__(self, config: RunnerConfig, tp_group: object | None = None, memory_probe: MemoryProbe | None = None):
        self.config = config
        # start-up time per phase, logged when the rank is ready
        self.startup = StartupPhases()
        self.model_config = cfg = load_model_config(config.model_dir)
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype(cfg.torch_dtype)
        tp = TPInfo(config.tp_rank, config.tp_size, tp_group)
        with self.startup.phase("weights"):
            self.model = HybridModel(cfg, tp, self.device)
            if config.load_format == "dummy":
                load_dummy_weights(
                    self.model,
                    self.dtype,
                    self.device,
                    tp,
                    model_dir=config.model_dir,
                    quantization=config.quantization,
                )
            else:
                load_weights(
                    self.model, config.model_dir, self.dtype, self.device, tp, config.show_progress, config.quantization
                )
        self.vocab_size = cfg.vocab_size
        self.max_width = config.verify_width
        self.mtp_step = config.mtp_step if self.model.mtp is not None else 0
        if config.mtp_step and self.model.mtp is None:
            raise ValueError(f"mtp_step={config.mtp_step} but {config.model_dir} has no MTP layer")
        mode = StateMode(config.ssm_state_mode)
        spec = dataclasses.replace(
            cfg.linear, num_k_heads=cfg.linear.num_k_heads // tp.size, num_v_heads=cfg.linear.num_v_heads // tp.size
        )
        self.linear_spec = spec
        state_config = StateConfig(
            mode=mode,
            max_requests=config.max_running_requests,
            max_width=self.max_width,
            state_dtype=config.state_dtype(),
            act_dtype=self.dtype,
            replay_capacity=config.replay_capacity,
            projection=config.replay_projection_mode if mode is StateMode.REPLAY else "inline",
            device=self.device,
            backend=config.state_backend,
        )
        shapes = self._kv_token_shapes(tp.size)
        slots = self._fitted_slots(state_config, shapes, tp, memory_probe)
        if slots != config.max_running_requests:
            self.config = config = dataclasses.replace(config, max_running_requests=slots)
            state_config = dataclasses.replace(state_config, max_requests=slots)
        self.state = create_state(spec, state_config)
        self.startup.mark("linear state")
        # every rank allocates the same KV slots (free memory differs a little between devices)
        self.kv_tokens = tp.min_over_ranks(runner_kv_tokens(self, shapes, memory_probe), self.device)
        self.kv = KVCache(
            len(cfg.full_layer_ids),
            shapes,
            self.kv_tokens,
            config.max_running_requests,
            kv_row_lengths(config, self.max_width, self.mtp_step)[0],
            self.dtype,
            self.device,
        )
        self.drafter = None
        if self.mtp_step:
            mtp_kv = KVCache(
                1,
                shapes,
                self.kv_tokens + mtp_extra_tokens(config, self.mtp_step),
                config.max_running_requests,
                kv_row_lengths(config, self.max_width, self.mtp_step)[1],
                self.dtype,
                self.device,
            )
            self.drafter = MtpDrafter(self.model, mtp_kv, self.max_width)
        self.startup.mark("KV cache")
        self.prefix_cache: RunnerPrefixCache | None = None
        if not config.disable_prefix_cache:
            self.prefix_cache = create_prefix_cache(
                self.state,
                self.kv,
                self.drafter,
                cfg.hidden_size,
                self.dtype,
                self.kv_bytes_per_token(),
                config.prefix_cache_state_fraction,
                config.prefix_cache_state_bytes,
            )
        self.startup.mark("prefix cache")
        if self.prefix_cache is not None and config.host_tier_name:
            # the server's host tier: checkpoints are copied there and requests resume from it (any replica)
            self.prefix_cache.attach_host(RunnerHostTier(self, config.host_tier_name))
        self._requests: dict[int, RequestRecord] = {}
        self._pending: PendingVerify | None = None
        # verifies accepted on the device, oldest first (at most two: one being read, one launched after it)
        self._unsettled: list[UnsettledStep] = []
        # checkpoints taken before a step changed rows that may have reached their limit (device_accept.py)
        self._held: dict[int, HeldCheckpoint] = {}
        self._folds_copy = CounterCopy()
        self.decode_graphs: DecodeGraphs | None = None
        # overlapped MTP steps over the decode and draft buffers (device_accept.py)
        self.spec_step_graphs: SpecStepGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        self.startup.mark("host tier")

    def init_decode_graphs(self, use_graphs: bool = True) -> bool:
        """Run decode-only steps through fixed buffers, captured as CUDA graphs when `use_graphs` and on CUDA
        (call after `warmup`); every model qualifies (the fused MoE and MLA's latent attention take no host value
        mid-step). Returns whether the fixed-buffer path is on."""
        max_batch = min(self.config.graph_max_batch_size, self.config.max_running_requests)
        self.decode_graphs = DecodeGraphs(self.model, self.kv, self.state, max_batch, self.max_width, use_graphs)
        self.decode_graphs.capture()
        if self.drafter is not None:
            drafter = self.drafter
            drafter.graphs = DraftGraphs(
                self.model, drafter.kv, max_batch, drafter.max_width, self.mtp_step, use_graphs
            )
            drafter.graphs.capture()
            if self.max_width == self.mtp_step + 1:
                # windows wider than the head's drafts (a larger `max_width`) verify synchronously
                graphs = SpecStepGraphs(self.model, self.state, self.decode_graphs, drafter.graphs, use_graphs)
                graphs.capture()
                self.spec_step_graphs = graphs
        return True

    def init_prefill_graphs(self, use_graphs: bool = True) -> bool:
        """Run a step's prefill rows of at most `config.prefill_graph_max_tokens` new tokens each (up to
        `GRAPHED_PREFILL_ROWS` of them, alone or beside decode rows that fit a decode bucket) through fixed buffers
        (`PrefillGraphs`), captured per token bucket when `use_graphs` and on CUDA (call after `warmup`). Returns
        whether the fixed-buffer path is on."""
        if self._prefill_graph_tokens() == 0:
            return False
        self.prefill_graphs = PrefillGraphs(self.model, self.kv, self.state, self._prefill_graph_tokens(), use_graphs)
        self.prefill_graphs.capture()
        return True

    def _prefill_graph_tokens(self) -> int:
        """The largest prefill bucket: the flag, capped at the longest request and at what the model's layers
        run as fast through fixed buffers as eagerly (`fixed_buffer_prefill_tokens`)."""
        tokens = min(self.config.prefill_graph_max_tokens, self.config.max_req_total_len)
        model_bound = self.model.fixed_buffer_prefill_tokens()
        return tokens if model_bound is None else min(tokens, model_bound)

    def _fitted_slots(
        self, state_config: StateConfig, shapes: tuple[tuple[int, ...], ...], tp: TPInfo, probe: MemoryProbe | None
    ) -> int:
        """`max_running_requests`, lowered (with a warning) where their linear state cannot fit beside the weights
        (`kv_sizing.fitted_request_slots`); every TP rank takes the smallest rank's count."""
        c = self.config
        probe = memory_probe_of(self.device, probe)
        if probe is None or c.max_total_token_num is not None:
            return c.max_running_requests
        meta = dataclasses.replace(state_config, max_requests=1, device=torch.device("meta"))
        state_bytes = create_state(self.linear_spec, meta).bytes_per_request()
        num_layers = len(self.model_config.full_layer_ids) + (1 if self.mtp_step else 0)
        slots = fitted_request_slots(
            probe(),
            requested=c.max_running_requests,
            mem_fraction=c.mem_fraction,
            state_bytes_per_request=state_bytes,
            kv_bytes_per_token=kv_bytes_per_token(shapes, self.dtype, num_layers),
            max_req_total_len=c.max_req_total_len,
        )
        slots = tp.min_over_ranks(slots, self.device)
        if slots < c.max_running_requests:
            logger.warning(
                "--max_running_requests %d: the %s linear state of that many requests (%.2f GiB, %.1f MiB each) does "
                "not fit beside the weights; running at most %d requests at once (lower --max_running_requests to "
                "silence this, or raise --mem_fraction, or use --ssm_state_mode replay / "
                "--linear_att_ssm_data_type bfloat16 for a smaller state)",
                c.max_running_requests,
                state_config.mode.value,
                state_bytes * c.max_running_requests / 2**30,
                state_bytes / 2**20,
                slots,
            )
        return slots

    def _kv_token_shapes(self, tp_size: int) -> tuple[tuple[int, ...], ...]:
        a = self.model_config.attention
        if a.kind == "mla":
            return a.kv_cache_shapes
        return ((max(a.num_kv_heads // tp_size, 1), a.head_dim),) * 2

    # requests and memory ---------------------------------------------------------------------------------
    def add_request(
        self, prefix: list[int] | None = None, host_tokens: int | None = None, namespace: bytes = DEFAULT_NAMESPACE
    ) -> int:
        """Reserve a state slot and a KV row; the handle is the KV row index. With `prefix` (the request's
        tokens) the request resumes from the prefix cache or its host tier (`host_tokens`: see
        `RunnerPrefixCache.resume`): `num_tokens(handle)` tells how many are committed. `namespace`: the prefix-cache
        namespace it resumes from and publishes to."""
        self._flush_checkpoints()
        if self.kv.num_free_rows() == 0 or self.state.num_free_slots() == 0:
            raise RuntimeError("no free request slot")
        handle = self.kv.alloc_row()
        req = self._requests[handle] = RequestRecord(handle, self.state.alloc(), namespace=namespace)
        if self.drafter is not None:
            self.drafter.kv.alloc_row()
        if prefix is not None and self.prefix_cache is not None:
            with torch.inference_mode():
                self.prefix_cache.resume(handle, req, prefix, host_tokens)
        return handle

    def free_request(self, handle: int) -> None:
        self._held.pop(handle, None)
        req = self._requests.pop(handle)
        self.kv.free_row(handle)
        self.state.free(req.state_slot)
        if self.drafter is not None:
            self.drafter.kv.free_row(handle)
        if self.prefix_cache is not None:
            self.prefix_cache.release(handle)

    def close(self) -> None:
        """Let go of what outlives a dropped runner: the host tier's writer threads and staging."""
        if self.prefix_cache is not None and self.prefix_cache.host is not None:
            self.prefix_cache.host.writer.close()

    def num_free_requests(self) -> int:
        return min(self.kv.num_free_rows(), self.state.num_free_slots())

    def num_free_kv_tokens(self) -> int:
        """Free KV slots plus those the prefix cache holds for no running request (evicted on demand)."""
        evictable = self.prefix_cache.cache.num_evictable_tokens() if self.prefix_cache is not None else 0
        return self.kv.num_free_tokens() + evictable

    def stats(self) -> dict[str, int | None]:
        """Counters for the metrics endpoint. On a GPU the value is the one copied at the previous call (the copy
        is made without waiting for the device, so a step in flight is never stalled for a metric)."""
        folds = self.state.counters().get("num_folds")
        return {"num_folds": None if folds is None else self._folds_copy.read(folds)}

    def bytes_per_request(self) -> int:
        """Linear-attention state bytes of one request slot (all layers, this state mode)."""
        return self.state.bytes_per_request()

    def kv_bytes_per_token(self) -> int:
        """KV bytes of one token over all full-attention layers (plus the MTP layer)."""
        extra = self.drafter.kv.bytes_per_token() if self.drafter is not None else 0
        return self.kv.bytes_per_token() + extra

    def num_tokens(self, handle: int) -> int:
        return self._requests[handle].num_tokens

    @torch.inference_mode()
    def export_request(
        self, handle: int, pack: Callable[[list[torch.Tensor]], list[TensorBlob]] | None = None
    ) -> RequestState:
        """See `ModelRunnerProtocol.export_request` (`lightllm.worker.transfer.request_state` says what moves)."""
        self._flush_checkpoints()
        if self._pending is not None:
            raise RuntimeError("export between forward and accept: the state is not committed")
        if self._is_unsettled(self._requests[handle]):
            raise RuntimeError("export before settle(): the state holds tokens the host has not counted")
        return export_request(self, self._requests[handle], pack or host_blobs)

    @torch.inference_mode()
    def import_request(
        self, state: RequestState, region: torch.Tensor | None = None, namespace: bytes = DEFAULT_NAMESPACE
    ) -> int:
        """See `ModelRunnerProtocol.import_request`."""
        handle = self.add_request(None, namespace=namespace)
        try:
            import_request(self, self._requests[handle], state, region)
        except Exception:
            self.free_request(handle)
            raise
        return handle

    # one step --------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        """Run one step (see `ModelRunnerProtocol.forward`). A step with decode rows must be followed by
        `accept` before the next forward."""
        self._flush_checkpoints()
        if self._pending is not None:
            raise RuntimeError("accept() must be called after a step with decode rows before the next forward")
        reqs = [self._requests[h] for h in batch.req_handles]
        if self._unsettled and any(self._is_unsettled(r) for r in reqs):
            raise RuntimeError("a row whose accepted counts are still on the device: settle() comes first")
        for h, req, cached in zip(batch.req_handles, reqs, batch.num_cached_tokens):
            assert cached == req.num_tokens, (
                f"request {h}: engine says {cached} cached tokens, runner has {req.num_tokens}"
            )
        if sum(batch.query_lens) > self.num_free_kv_tokens():
            raise RuntimeError(f"step needs {sum(batch.query_lens)} KV slots, {self.num_free_kv_tokens()} free")
        handles, q_lens = np.asarray(batch.req_handles), np.asarray(batch.query_lens)
        self.kv.extend_many(handles, q_lens)
        np_ = batch.num_prefill_rows
        state_slots = [r.state_slot for r in reqs]
        # decode rows padded to one width: real tokens go to their place in that layout
        width = padded_decode_width(batch.query_lens, np_, self.max_width)
        layout = padded_token_index(batch.query_lens, np_, width)
        ids = np.zeros(sum(batch.query_lens[:np_]) + width * batch.num_decode_rows, dtype=np.int64)
        ids[layout] = batch.input_ids.numpy()
        # a decode row's first token may still be on the device (the last step's sample, not yet seen by the host)
        first_tokens = batch.decode_input_ids
        fixed = self._forward_fixed_buffers(batch, ids, q_lens, handles, state_slots, first_tokens)
        ids_dev = None
        if fixed is not None:
            hidden, decode_rows = fixed
        else:
            ctx = build_context(
                batch.query_lens,
                batch.num_cached_tokens,
                np_,
                batch.req_handles,
                self.kv,
                self.state,
                state_slots,
                decode_width=self.max_width,
            )
            ids_dev = self._device_ids(batch, ids, width)
            hidden = self.model(ids_dev, ctx)
            if np_:
                self.state.finish_prefill(ctx.prefill_rows.slots)
            decode_rows = ctx.decode_rows
        real = to_device(layout, self.device)
        select = real[self._logit_rows(batch)]
        if self.drafter is not None:
            if ids_dev is None:
                ids_dev = self._device_ids(batch, ids, width)
            self._remember_for_mtp(batch, reqs, hidden[real], ids_dev[real])
        # prefill tokens are committed now; decode rows commit in `accept`
        for req, q in zip(reqs[:np_], batch.query_lens[:np_]):
            req.num_tokens += q
        if decode_rows is not None:
            self._pending = PendingVerify(batch.req_handles[np_:], batch.query_lens[np_:], decode_rows)
        out_hidden = hidden[select]
        out = ForwardOutput(logits=self.model.logits(out_hidden), hidden=out_hidden)
        if any(batch.prefill_prompt_logits):
            out.prompt_logits, out.prompt_logits_offsets = self._prompt_logits(batch, hidden, real)
        return out

    def _forward_fixed_buffers(
        self,
        batch: ForwardBatch,
        ids: np.ndarray,
        q_lens: np.ndarray,
        handles: np.ndarray,
        state_slots: list[int],
        first_tokens: torch.Tensor | None,
    ) -> tuple[torch.Tensor, DecodeRows | None] | None:
        """The step through the graphs' fixed buffers where its shape has them: decode rows replay a decode graph,
        and up to `GRAPHED_PREFILL_ROWS` prefill rows that each fit a prefill graph replay it one after another
        (before the decode graph). The parts share no state, KV or attention, so separate forwards compute what
        one would, without an eager step's launches. Returns the step's hidden states in its token layout and the
        decode rows (or None), or None when the step runs eagerly (its prompts' eager launches, not its decode
        rows', are what a mixed step costs on the host, so graphing only its decode rows gains nothing)."""
        np_ = batch.num_prefill_rows
        num_decode = len(q_lens) - np_
        decode, prefill = self.decode_graphs, self.prefill_graphs
        graph_prefill = (
            0 < np_ <= GRAPHED_PREFILL_ROWS
            and prefill is not None
            and all(prefill.bucket(int(q)) is not None for q in q_lens[:np_])
        )
        if len(q_lens) == 0 or (np_ and not graph_prefill):
            return None
        if num_decode and (decode is None or decode.bucket(num_decode) is None):
            return None
        parts, decode_rows, start = [], None, 0
        for i in range(np_):
            n = int(q_lens[i])
            hidden = prefill.run(ids[start : start + n], batch.num_cached_tokens[i], int(handles[i]), state_slots[i])
            # every bucket's output lives in one memory pool: the next replay overwrites this one
            parts.append(hidden[:n] if i == np_ - 1 else hidden[:n].clone())
            start += n
        num_prefill_tokens = start
        if num_decode:
            cached = np.asarray(batch.num_cached_tokens[np_:])
            hidden, decode_rows = decode.run(
                ids[num_prefill_tokens:],
                q_lens[np_:],
                cached,
                handles[np_:],
                np.asarray(state_slots[np_:]),
                first_tokens,
                batch.decode_draft_ids,
            )
            parts.append(hidden)
        return (parts[0] if len(parts) == 1 else torch.cat(parts)), decode_rows

    def _logit_rows(self, batch: ForwardBatch) -> torch.Tensor:
        """Real-token indices (flat row order) that get logits: every decode token, the last prompt token."""
        q = np.asarray(batch.query_lens, dtype=np.int64)
        np_ = batch.num_prefill_rows
        ends = np.cumsum(q)
        last_chunk = np.asarray(batch.prefill_is_last_chunk or [True] * np_, dtype=bool)
        prefill = (ends[:np_] - 1)[last_chunk]
        decode = np.arange(int(ends[np_ - 1]) if np_ else 0, int(ends[-1]) if len(q) else 0, dtype=np.int64)
        return to_device(np.concatenate([prefill, decode]), self.device)

    def _prompt_logits(
        self, batch: ForwardBatch, hidden: torch.Tensor, real: torch.Tensor
    ) -> tuple[torch.Tensor, list[int]]:
        """Logits at every position of the prefill rows that ask for them, and the per-row cumulative starts."""
        np_ = batch.num_prefill_rows
        q = np.asarray(batch.query_lens[:np_], dtype=np.int64)
        asks = np.asarray(batch.prefill_prompt_logits, dtype=bool)
        starts = np.cumsum(q) - q
        index = np.concatenate([np.arange(s, s + n, dtype=np.int64) for s, n in zip(starts[asks], q[asks])])
        offsets = np.concatenate([[0], np.cumsum(q * asks)]).tolist()
        rows = real[to_device(index, self.device)]
        return self.model.logits(hidden[rows]), offsets

    def _device_ids(self, batch: ForwardBatch, ids: np.ndarray, width: int) -> torch.Tensor:
        """The step's token ids on the device in its padded layout, decode rows' first tokens and drafts taken
        from the device tensors that stand for what the host does not know yet."""
        ids_dev = to_device(ids, self.device)
        if batch.num_decode_rows:
            windows = ids_dev[len(ids) - width * batch.num_decode_rows :].view(batch.num_decode_rows, width)
            if batch.decode_input_ids is not None:
                windows[:, 0] = batch.decode_input_ids
            if batch.decode_draft_ids is not None:
                write_window_drafts(windows, batch.decode_draft_ids)
        return ids_dev

    def _remember_for_mtp(self, batch, reqs, hidden, token_ids) -> None:
        """Queue the step's hidden states and the tokens that follow them (`token_ids`: the step's real tokens on
        the device, flat in row order) for the next `draft`."""
        start = 0
        for req, q in zip(reqs, batch.query_lens):
            if req.mtp_hidden:
                req.mtp_next_ids.append((token_ids, start, 1))
            if q > 1:
                req.mtp_next_ids.append((token_ids, start + 1, q - 1))
            req.mtp_hidden.append((hidden, start, q))
            start += q

    @torch.inference_mode()
    def accept(self, handles: list[int], num_accepted: list[int]) -> None:
        """Keep the first `num_accepted[i]` tokens of each decode row of the last step (every row listed)."""
        pending = self._pending
        if pending is None:
            raise RuntimeError("accept() without a preceding step with decode rows")
        accepted = dict(zip(handles, num_accepted))
        if sorted(accepted) != sorted(pending.handles):
            raise ValueError(f"accept() must list exactly the decode rows {pending.handles}, got {handles}")
        counts = [accepted[h] for h in pending.handles]
        for h, w, a in zip(pending.handles, pending.widths, counts):
            if not 1 <= a <= w:
                raise ValueError(f"request {h}: num_accepted {a} outside [1, {w}]")
        self.state.accept(pending.rows, to_device(np.asarray(counts, dtype=np.int32), self.device))
        lengths = []
        for h, w, a in zip(pending.handles, pending.widths, counts):
            req = self._requests[h]
            req.num_tokens += a
            lengths.append(req.num_tokens)
            if self.drafter is not None and a < w:
                self._drop_rejected_mtp(req, w - a)
        self.kv.truncate_many(np.asarray(pending.handles), np.asarray(lengths))
        self._pending = None

    @staticmethod
    def _drop_rejected_mtp(req: RequestRecord, num_rejected: int) -> None:
        drop_last_rows(req.mtp_hidden, num_rejected)
        drop_last_rows(req.mtp_next_ids, num_rejected)

    # MTP -------------------------------------------------------------------------------------------------
    def draft(self, handles: list[int], next_tokens: torch.Tensor, mtp_step: int) -> torch.Tensor:
        """Chained greedy MTP drafts `[len(handles), mtp_step]` int64 after each request's `next_tokens`."""
        return self.draft_with_logits(handles, next_tokens, mtp_step)[0]

    @torch.inference_mode()
    def draft_with_logits(
        self, handles: list[int], next_tokens: torch.Tensor, mtp_step: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`draft` plus the fp32 logits of every draft step `[len(handles), mtp_step, vocab]`."""
        if self.drafter is None:
            raise RuntimeError("this runner has no MTP head (mtp_step = 0 or no mtp.* weights)")
        return self.drafter.draft(handles, [self._requests[h] for h in handles], next_tokens.tolist(), mtp_step)

    def pin_fla(self, pending: Future | None = None) -> None:
        """fla's launch configurations pinned from the shipped tables (`warmup_steps.pin_fla`), before `warmup`;
        `pending`: that work started earlier on a thread (`warmup_steps.start_pin_fla`)."""
        pin_fla(self, pending)

    def warmup(self, max_num_tokens: int, progress: bool = True) -> int:
        """Compile and tune every kernel variant serving launches (`warmup_steps.warm_up`), once, after `pin_fla`
        and before serving and `init_decode_graphs`. `max_num_tokens`: `--max_num_batched_tokens`. Returns the
        number of warm-up calls."""
        return warm_up(self, max_num_tokens, progress)

    def warmup_attention(self) -> int:
        """Every tile and split variant of the attention kernels at each attention shape of the model, on scratch
        tensors (`warmup_steps.warm_attention_kernels`). A no-op on CPU; returns the launch count."""
        if self.device.type != "cuda":
            return 0
        launches = warm_attention_kernels(self.model, self.dtype, self.device)
        torch.cuda.synchronize(self.device)
        return launches
