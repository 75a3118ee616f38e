"""Tensor-parallel runners in lockstep: rank 0's `LockstepRunner` and the followers' `follow` loop.

The engine drives rank 0 exactly as it drives a single runner. Each call that changes device or allocator state
is first broadcast as a `Plan` (method name and arguments; GPU tensors among them follow as broadcasts on the
model's NCCL group), then run on rank 0; the followers run the same call on their own runner, so every rank makes
the same slot, KV and prefix-cache decisions and meets the model's collectives in the same order. Reads (free slots, prefix matches, stats) stay on rank 0: the
ranks' allocators are identical. Only rank 0 samples; the followers' logits are dropped.

Checkpoints leave and enter the group laid out by global head (`layout`): export gathers every rank's heads on
rank 0, import hands each rank its heads, so a checkpoint moves between engines of any `--tp`.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
from collections.abc import Callable

import torch

from lightllm.cache.payload import RequestState, TensorBlob
from lightllm.cache.prefix.namespace import DEFAULT_NAMESPACE
from lightllm.linear_att.base import Checkpoint
from lightllm.worker.tp.group import Plan, broadcast_plan, gather_to_rank0
from lightllm.worker.tp.layout import merge_checkpoints, merge_request_states, split_checkpoint, split_request_state

logger = logging.getLogger(__name__)

# runner calls that change device or allocator state: run on every rank, in the order rank 0 makes them
LOCKSTEP = frozenset(
    {
        "add_request",
        "free_request",
        "publish",
        "publish_many",
        "evict_prefix_cache",
        "forward",
        "accept",
        "verify_on_device",
        "hold_checkpoints",
        "settle",
        "draft",
        "draft_with_logits",
    }
)
# reads: rank 0 answers for all ranks
LOCAL = frozenset(
    {
        "can_verify_on_device",
        "match_prefix",
        "prefix_cache_stats",
        "num_free_requests",
        "num_free_kv_tokens",
        "stats",
        "bytes_per_request",
        "kv_bytes_per_token",
        "num_tokens",
    }
)
# run by every rank while it builds its runner, never later
START_UP = frozenset({"pin_fla", "warmup", "warmup_attention", "init_decode_graphs", "init_prefill_graphs"})
# run by every rank when the runner is dropped (this class's own `close` sends it to the followers)
SHUT_DOWN = frozenset({"close"})


def _map_leaves(value, leaf: type, f: Callable):
    """`value` with every `leaf` instance inside it (lists, tuples, dicts, dataclass fields) replaced by `f(it)`,
    in a fixed traversal order."""
    if isinstance(value, leaf):
        return f(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_map_leaves(v, leaf, f) for v in value)
    if isinstance(value, dict):
        return {k: _map_leaves(v, leaf, f) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = [x.name for x in dataclasses.fields(value) if x.init]
        return dataclasses.replace(value, **{name: _map_leaves(getattr(value, name), leaf, f) for name in fields})
    return value


def _host(value):
    """A copy of `value` that pickles without device tensors (they would unpickle onto rank 0's device)."""
    return _map_leaves(value, torch.Tensor, lambda t: t.detach().cpu())


@dataclasses.dataclass(frozen=True)
class _OnDevice:
    """A plan argument that stays on the device: it follows the plan as a broadcast on the model's group (NCCL),
    so rank 0 never waits for it on the host (the overlap schedule's in-flight decode tokens)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def stays_on_device(t: torch.Tensor) -> bool:
    """Whether a plan's tensor goes as a broadcast on the model's group instead of inside the pickled plan."""
    return t.device.type == "cuda"


def _split_device_tensors(value) -> tuple[object, list[torch.Tensor]]:
    """`value` with its device tensors replaced by `_OnDevice` markers, and those tensors in traversal order."""
    found: list[torch.Tensor] = []

    def mark(t: torch.Tensor):
        if not stays_on_device(t):
            return t
        found.append(t.contiguous())
        return _OnDevice(tuple(t.shape), t.dtype)

    return _map_leaves(value, torch.Tensor, mark), found


def _receive_device_tensors(value, device: torch.device):
    """A follower's side of `_split_device_tensors`: each marker becomes the tensor rank 0 broadcasts for it."""
    import torch.distributed as dist

    def fill(marker: _OnDevice) -> torch.Tensor:
        t = torch.empty(marker.shape, dtype=marker.dtype, device=device)
        dist.broadcast(t, src=0)
        return t

    return _map_leaves(value, _OnDevice, fill)


def _export_checkpoint(runner, control, handles: list[int]) -> Checkpoint | None:
    parts = gather_to_rank0(_host(runner.export_checkpoint(handles)), control)
    if parts is None:
        return None
    merged = merge_checkpoints(parts, runner.linear_spec)
    return Checkpoint(conv=merged.conv.to(runner.device), ssm=merged.ssm.to(runner.device))


def _import_checkpoint(runner, control, handles: list[int], checkpoint: Checkpoint) -> None:
    mine = split_checkpoint(checkpoint, runner.linear_spec, runner.model.tp)
    runner.import_checkpoint(handles, Checkpoint(conv=mine.conv.to(runner.device), ssm=mine.ssm.to(runner.device)))


def _export_request(runner, control, handle: int) -> RequestState | None:
    parts = gather_to_rank0(runner.export_request(handle), control)
    return None if parts is None else merge_request_states(parts, runner)


def _import_request(runner, control, state: RequestState, namespace: bytes = DEFAULT_NAMESPACE) -> int:
    return runner.import_request(split_request_state(state, runner), namespace=namespace)


GLOBAL_LAYOUT_CALLS: dict[str, Callable] = {
    "export_checkpoint": _export_checkpoint,
    "import_checkpoint": _import_checkpoint,
    "export_request": _export_request,
    "import_request": _import_request,
}
# calls that move a checkpoint or a request's state by global head (a collective on the control group besides the
# runner call); LockstepRunner defines `export_request` / `import_request` itself (packing and device regions)
GLOBAL_LAYOUT = frozenset(GLOBAL_LAYOUT_CALLS)


def run_plan(runner, plan: Plan, control):
    """What every rank does with one plan (rank 0 keeps the result)."""
    special = GLOBAL_LAYOUT_CALLS.get(plan.method)
    if special is not None:
        return special(runner, control, *plan.args, **plan.kwargs)
    return getattr(runner, plan.method)(*plan.args, **plan.kwargs)


class LockstepRunner:
    """Rank 0's runner as the engine sees it: the `ModelRunner` protocol, run on every rank of `group`."""

    def __init__(self, runner, group, owns_group: bool = False):
        self.runner = runner
        self.group = group
        self.owns_group = owns_group

    def __getattr__(self, name: str):
        # only reached for names this class does not define: the wrapped runner's methods and attributes
        value = getattr(self.runner, name)
        if not callable(value):
            return value
        if name in LOCKSTEP or name in GLOBAL_LAYOUT:
            return lambda *args, **kwargs: self._everywhere(Plan(name, args, kwargs))
        if name in LOCAL:
            return value
        if name in START_UP:
            raise AttributeError(f"{name} runs on every rank while it builds its runner, not through rank 0")
        raise AttributeError(
            f"ModelRunner.{name} is not classified for tensor parallelism: add it to LOCKSTEP (changes device or "
            "allocator state), GLOBAL_LAYOUT or LOCAL (a read) in lightllm/worker/tp/lockstep.py"
        )

    def _everywhere(self, plan: Plan):
        import torch.distributed as dist

        (args, kwargs), on_device = _split_device_tensors((plan.args, plan.kwargs))
        self.group.send(dataclasses.replace(plan, args=args, kwargs=kwargs))
        for t in on_device:
            dist.broadcast(t, src=0)
        return run_plan(self.runner, plan, self.group.control)

    def add_request(self, prefix: list[int] | None = None, namespace: bytes = DEFAULT_NAMESPACE) -> int:
        """A new request on every rank. Rank 0 chooses the host-tier entry it resumes from (if any), so that
        every rank imports its shard of the same entry."""
        cache = self.runner.prefix_cache
        host = cache.host_match(prefix, namespace) if prefix and cache is not None else 0
        return self._everywhere(Plan("add_request", (prefix,), {"host_tokens": host, "namespace": namespace}))

    def export_request(self, handle: int, pack: Callable | None = None) -> RequestState:
        """Prefill/decode disaggregation: the request's committed state with every rank's heads, in global order
        (host blobs, or packed by `pack` from rank 0's device; see `ModelRunner.export_request`)."""
        state = self._everywhere(Plan("export_request", (handle,)))
        return state if pack is None else _repack(state, pack, self.runner.device)

    def import_request(
        self, state: RequestState, region: torch.Tensor | None = None, namespace: bytes = DEFAULT_NAMESPACE
    ) -> int:
        """A new request on every rank holding its heads of `state` (laid out by global head); returns the handle.
        Blobs in a device `region` are read on rank 0 and sent to the followers with the plan."""
        if region is not None:
            state = _map_blobs(state, lambda b: TensorBlob.of(b.view_in(region)) if b.offset is not None else b)
        return self._everywhere(Plan("import_request", (state,), {"namespace": namespace}))

    def close(self) -> None:
        """Drop this runner on every rank; the group stays, ready to build another, unless this runner owns it."""
        self.group.send(Plan("close"))
        self.runner.close()
        self.runner = None
        _release_memory()
        if self.owns_group:
            self.group.shutdown()


def _map_blobs(state: RequestState, f: Callable[[TensorBlob], TensorBlob]) -> RequestState:
    return RequestState(
        num_tokens=state.num_tokens,
        kv=[f(b) for b in state.kv],
        conv=f(state.conv),
        ssm=f(state.ssm),
        mtp_kv=[f(b) for b in state.mtp_kv],
        mtp_len=state.mtp_len,
        mtp_hidden=None if state.mtp_hidden is None else f(state.mtp_hidden),
    )


def _repack(state: RequestState, pack: Callable, device: torch.device) -> RequestState:
    """The same state with its tensors packed by `pack` (one call, in the order `transfer.request_state.export_request` uses)."""
    blobs = [*state.kv, state.conv, state.ssm, *state.mtp_kv] + (
        [state.mtp_hidden] if state.mtp_hidden is not None else []
    )
    packed = iter(pack([b.tensor(device) for b in blobs]))
    return _map_blobs(state, lambda _: next(packed))


def follow(control, build: Callable) -> None:
    """A follower rank's loop: build, run and drop runners as rank 0's plans say, until `exit`."""
    runner = None
    while True:
        plan = broadcast_plan(None, control)
        if plan.method == "exit":
            # leave the group before the interpreter exits: a process group torn down by static destructors at
            # exit can abort the process ("terminate called without an active exception")
            torch.distributed.destroy_process_group()
            return
        if plan.method == "build":
            runner = build(*plan.args)
        elif plan.method == "close":
            if runner is not None:
                runner.close()
            runner = None
            _release_memory()
        else:
            plan = _receive_device_tensors(plan, runner.device)
            try:
                run_plan(runner, plan, control)
            except Exception:
                # rank 0 runs the same call on the same state and meets the same error; the engine handles it there
                logger.debug("follower call %s failed", plan.method, exc_info=True)


def _release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
