"""`LinearAttState.decode` / `accept` are CUDA-graph safe: no host sync on the Python path of any state mode.

With backend="triton" (interpreter on CPU) the kernels stand in for the GPU; everything outside a kernel body is
what the engine would capture in a CUDA graph. A guard records every op that would need the device's data on the
host (`.item()`, `bool(t)`, `.tolist()`, `.numpy()`, `nonzero`, boolean-mask indexing, `masked_select`) while it
runs outside a kernel, and the outputs must still equal the torch twins'.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from triton.runtime.interpreter import InterpretedFunction

from unit_tests.helpers.asserts import assert_rel_close
from unit_tests.linear_att import scenarios as sc

aten = torch.ops.aten
# ops whose result size or value must travel to the host
SYNC_OPS = {aten._local_scalar_dense, aten.nonzero, aten.masked_select, aten.unique_consecutive, aten._unique2}
INDEX_OPS = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}


class HostSyncGuard(TorchDispatchMode):
    """Records host-sync ops (and `.tolist()` / `.numpy()`, which bypass the dispatcher) outside kernel bodies."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.violations: list[str] = []
        self.kernel_depth = 0
        guard = self

        def kernel_run(original):
            @functools.wraps(original)
            def run(self, *args, **kwargs):
                guard.kernel_depth += 1
                try:
                    return original(self, *args, **kwargs)
                finally:
                    guard.kernel_depth -= 1

            return run

        def host_read(name, original):
            @functools.wraps(original)
            def read(self, *args, **kwargs):
                if guard.active and guard.kernel_depth == 0:
                    guard.violations.append(f"Tensor.{name}")
                return original(self, *args, **kwargs)

            return read

        self.active = False
        monkeypatch.setattr(InterpretedFunction, "run", kernel_run(InterpretedFunction.run))
        for name in ("tolist", "numpy"):
            monkeypatch.setattr(torch.Tensor, name, host_read(name, getattr(torch.Tensor, name)))

    def __enter__(self):
        self.active = True
        return super().__enter__()

    def __exit__(self, *exc):
        self.active = False
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.kernel_depth == 0:
            packet = func.overloadpacket
            if packet in SYNC_OPS:
                self.violations.append(str(func))
            elif packet in INDEX_OPS and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ())
            ):
                self.violations.append(f"{func} with a boolean mask")
        return func(*args, **(kwargs or {}))

    def wrap(self, method):
        @functools.wraps(method)
        def guarded(*args, **kwargs):
            with self:
                return method(*args, **kwargs)

        return guarded


def _guard_decode_accept(state, monkeypatch) -> HostSyncGuard:
    guard = HostSyncGuard(monkeypatch)
    state.decode = guard.wrap(state.decode)
    state.accept = guard.wrap(state.accept)
    return guard


def _hold_bytes(state) -> list[torch.Tensor]:
    return [t.select(dim, state.hold_slot).clone() for t, dim in state._per_slot_tensors()]


def _run(spec, mode, backend, monkeypatch=None):
    state = sc.make_state(spec, mode, max_requests=3, max_width=3, replay_capacity=4, backend=backend)
    guard = None if monkeypatch is None else _guard_decode_accept(state, monkeypatch)
    params = sc.make_params(spec, seed=3)
    streams = sc.make_streams(spec, 3, 40, seed=4)
    slots = [state.alloc() for _ in range(3)]
    run = sc.new_run(spec, 3)
    sc.prefill(state, spec, params, streams, slots, [5, 1, 3], run)
    hold_before = _hold_bytes(state)
    # no NaN poisoning here (it would write HOLD bytes itself); the lifecycle tests poison
    sc.rounds(state, spec, params, streams, slots, run, num_rounds=4, max_width=3, seed=5, hold_rows=1, poison=False)
    for before, after in zip(hold_before, _hold_bytes(state), strict=True):
        assert torch.equal(before, after), "the HOLD slot changed"
    return state, run, guard


# the Python path does not depend on the algorithm (GDN is KDA with GK = 1): one KDA case keeps the runtime down
@pytest.mark.parametrize("algo,mode", [("gdn", "native"), ("gdn", "compact"), ("gdn", "replay"), ("kda", "replay")])
def test_decode_accept_without_host_sync(algo, mode, monkeypatch):
    spec = sc.make_spec(algo, num_k_heads=1, ratio=2, head_k_dim=8, head_v_dim=8, num_layers=1)
    triton_state, triton_run, guard = _run(spec, mode, "triton", monkeypatch)
    assert guard.violations == [], f"{mode} decode/accept synced with the host: {sorted(set(guard.violations))}"
    torch_state, torch_run, _ = _run(spec, mode, "torch")
    for layer in range(spec.num_layers):
        for req in range(3):
            assert_rel_close(
                f"layer {layer} request {req}", triton_run.stacked(layer, req), torch_run.stacked(layer, req), 1e-5
            )
    slots = torch.tensor([0, 1, 2], dtype=torch.int32)
    got, want = triton_state.export_checkpoint(slots), torch_state.export_checkpoint(slots)
    assert torch.equal(got.conv, want.conv), "conv windows differ"
    assert_rel_close("ssm", got.ssm, want.ssm, 1e-5)


def test_guard_catches_host_syncs(monkeypatch):
    """Teeth: the torch twins may sync (they only run on CPU); the guard must see it."""
    spec = sc.make_spec("gdn", num_k_heads=1, ratio=2, head_k_dim=8, head_v_dim=8, num_layers=1)
    _, _, guard = _run(spec, "replay", "torch", monkeypatch)
    assert guard.violations, "the guard saw no host sync in the torch twins (which use .any() and nonzero)"


@pytest.mark.parametrize("mode", ["native", "compact", "replay"])
def test_prefill_rows_without_host_sync(mode, monkeypatch):
    """A step's prefill of several rows (second chunks resuming their states, one row without tokens) waits for the
    device nowhere outside the chunk kernel (fla on CUDA; its torch twin here, which may sync, runs as a kernel),
    and hands it one int64 offsets tensor for all layers; the row without tokens keeps its state and the others
    match the torch backend."""
    from lightllm.linear_att.modes import common

    spec = sc.make_spec("gdn", num_k_heads=1, ratio=2, head_k_dim=8, head_v_dim=8, num_layers=2)
    guard = HostSyncGuard(monkeypatch)
    chunk = common.ops.chunk_delta_rule

    offsets = []

    def chunk_as_kernel(*args, **kwargs):
        offsets.append(args[6])
        guard.kernel_depth += 1
        try:
            return chunk(*args, **kwargs)
        finally:
            guard.kernel_depth -= 1

    monkeypatch.setattr(common.ops, "chunk_delta_rule", chunk_as_kernel)
    runs = {}
    for backend in ("triton", "torch"):
        state, run, _ = _run(spec, mode, backend)
        slots = torch.tensor([0, 1, 2], dtype=torch.int32)
        before = state.export_checkpoint(slots)
        params, streams = sc.make_params(spec, seed=3), sc.make_streams(spec, 3, 40, seed=4)
        if backend == "triton":
            state.prefill = guard.wrap(state.prefill)
        offsets.clear()
        sc.prefill(state, spec, params, streams, [0, 1, 2], [4, 0, 2], run)
        # every layer hands the chunk kernel the same int64 offsets (fla reuses what it derived from them)
        assert len(offsets) == spec.num_layers and all(o is offsets[0] for o in offsets)
        assert offsets[0].dtype == torch.int64 and offsets[0].tolist() == [0, 4, 4, 6]
        after = state.export_checkpoint(slots)
        assert torch.equal(after.ssm[:, 1], before.ssm[:, 1]), "the row without tokens changed its state"
        assert torch.equal(after.conv[:, 1], before.conv[:, 1]), "the row without tokens changed its conv window"
        runs[backend] = (run, after)
    assert guard.violations == [], f"{mode} prefill synced with the host: {sorted(set(guard.violations))}"
    (triton_run, got), (torch_run, want) = runs["triton"], runs["torch"]
    for layer in range(spec.num_layers):
        for req in (0, 2):
            assert_rel_close(
                f"layer {layer} request {req}", triton_run.stacked(layer, req), torch_run.stacked(layer, req), 1e-5
            )
    assert_rel_close("ssm", got.ssm, want.ssm, 1e-5)
