"""Device placement of data-parallel replicas: `place_replicas` over (dp, tp, visible devices) with exact device
lists and refusals, then what each replica's engine is given (`replica_args`, `runner_config`, the TP ranks'
devices), with the CUDA device count passed in (no device needed)."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from lightllm.server.args import ServerArgs
from lightllm.server.dp.placement import place_replicas
from lightllm.server.dp.replicas import replica_args, replica_placement
from lightllm.server.pd.node_replicas import NodeReplicas
from lightllm.server.runner_factory import rank_device, runner_config


@pytest.mark.parametrize(
    "dp, tp, visible, devices, shared",
    [
        (1, 1, 1, [[0]], False),
        (1, 1, 8, [[0]], False),
        (2, 1, 2, [[0], [1]], False),
        (3, 1, 8, [[0], [1], [2]], False),
        (2, 2, 4, [[0, 1], [2, 3]], False),
        (3, 2, 7, [[0, 1], [2, 3], [4, 5]], False),
        (2, 3, 6, [[0, 1, 2], [3, 4, 5]], False),
        (1, 4, 4, [[0, 1, 2, 3]], False),
        # one visible device, one rank per replica: they share it
        (2, 1, 1, [[0], [0]], True),
        (4, 1, 1, [[0], [0], [0], [0]], True),
    ],
    ids=lambda v: str(v),
)
def test_placement(dp, tp, visible, devices, shared):
    placement = place_replicas(dp, tp, visible)
    assert [list(d) for d in placement.devices] == devices
    assert placement.shared is shared
    assert [placement.base_device(i) for i in range(dp)] == [d[0] for d in devices]


@pytest.mark.parametrize(
    "dp, tp, visible, message",
    [
        # several devices, too few: no silent stacking on some of them
        (
            3,
            1,
            2,
            "--dp 3 x --tp 1 needs 3 CUDA devices, 2 visible: lower --dp or --tp (replicas share a device "
            "only with --tp 1 and exactly one device visible (CUDA_VISIBLE_DEVICES))",
        ),
        (2, 2, 3, "--dp 2 x --tp 2 needs 4 CUDA devices, 3 visible"),
        # one device, but each replica needs several
        (
            2,
            2,
            1,
            "--dp 2 x --tp 2 needs 4 CUDA devices, 1 visible: lower --dp or --tp (replicas share the one "
            "visible device only with --tp 1)",
        ),
        (1, 2, 1, "--tp 2 needs 2 CUDA devices, 1 visible"),
        (1, 4, 2, "--tp 4 needs 4 CUDA devices, 2 visible"),
        (2, 1, 0, "--dp 2 x --tp 1 needs 2 CUDA devices, 0 visible"),
        (0, 1, 4, "--dp and --tp must be at least 1, got --dp 0 --tp 1"),
    ],
    ids=lambda v: str(v),
)
def test_placement_refusals(dp, tp, visible, message):
    with pytest.raises(ValueError) as info:
        place_replicas(dp, tp, visible)
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)


def test_the_same_shape_fits_once_enough_devices_are_visible():
    # the refusal above is about the count only: one more device and the same flags are placed
    with pytest.raises(ValueError):
        place_replicas(2, 2, 3)
    assert [list(d) for d in place_replicas(2, 2, 4).devices] == [[0, 1], [2, 3]]


def _cuda(**kw) -> ServerArgs:
    return ServerArgs(device="cuda", mem_fraction=0.8, **kw)


def _devices(args: ServerArgs) -> list[str]:
    """The torch device of each TP rank of one engine, as its runners are configured."""
    return [runner_config(args, rank, args.tp).device for rank in range(args.tp)]


def test_own_devices_replica_args_and_rank_devices():
    args = _cuda(dp=2, tp=2)
    placement = replica_placement(args, num_devices=4)
    replicas = [replica_args(args, i, placement) for i in range(2)]
    assert [r.base_device for r in replicas] == [0, 2]
    # a replica on devices of its own keeps the whole memory share
    assert [r.mem_fraction for r in replicas] == [0.8, 0.8]
    assert [_devices(r) for r in replicas] == [["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"]]


def test_one_rank_replicas_on_their_own_device():
    args = _cuda(dp=3)
    placement = replica_placement(args, num_devices=4)
    replicas = [replica_args(args, i, placement) for i in range(3)]
    assert [_devices(r) for r in replicas] == [["cuda:0"], ["cuda:1"], ["cuda:2"]]
    assert [r.mem_fraction for r in replicas] == [0.8, 0.8, 0.8]


def test_shared_device_splits_the_memory_share_and_says_so(caplog):
    args = _cuda(dp=2)
    with caplog.at_level(logging.INFO, logger="lightllm.server.dp.replicas"):
        placement = replica_placement(args, num_devices=1)
    assert (
        "the 2 data-parallel replicas share CUDA device 0 (the only one visible), each with 1/2 of --mem_fraction (0.4)"
        in caplog.text
    )
    replicas = [replica_args(args, i, placement) for i in range(2)]
    assert [r.base_device for r in replicas] == [0, 0]
    assert [r.mem_fraction for r in replicas] == [0.4, 0.4]
    assert [_devices(r) for r in replicas] == [["cuda:0"], ["cuda:0"]]


def test_shared_device_with_a_token_count_keeps_it():
    args = ServerArgs(device="cuda", dp=2, max_total_token_num=4096)
    replicas = [replica_args(args, i, replica_placement(args, num_devices=1)) for i in range(2)]
    assert [(r.max_total_token_num, r.mem_fraction) for r in replicas] == [(4096, None), (4096, None)]


def test_refused_placement_reaches_the_launcher():
    with pytest.raises(ValueError, match="--dp 2 x --tp 2 needs 4 CUDA devices, 2 visible"):
        replica_placement(_cuda(dp=2, tp=2), num_devices=2)


def test_cpu_replicas_are_processes_with_the_same_flags():
    args = ServerArgs(device="cpu", dp=2, tp=2, mem_fraction=0.8)
    assert replica_placement(args, num_devices=4) is None
    replicas = [replica_args(args, i, None) for i in range(2)]
    assert all(r == args for r in replicas)
    assert _devices(replicas[0]) == ["cpu", "cpu"]


def test_rank_device_without_a_base_keeps_todays_devices():
    # a single engine (no replica placement): one rank on the current device, TP rank r on cuda:r
    assert rank_device(_cuda()) == "cuda"
    assert _devices(_cuda(tp=2)) == ["cuda:0", "cuda:1"]
    # a base moves every rank, and a lone rank gets an explicit index
    assert _devices(_cuda(tp=2, base_device=4)) == ["cuda:4", "cuda:5"]
    assert _devices(_cuda(base_device=3)) == ["cuda:3"]


def test_pd_node_replicas_get_their_own_devices():
    args = ServerArgs(run_mode="decode", device="cuda", dp=2, tp=2, mem_fraction=0.6)
    node = NodeReplicas(args, info=None, num_cuda_devices=4)
    assert [(a.dp, a.base_device, a.mem_fraction) for a in node.replica_args] == [(1, 0, 0.6), (1, 2, 0.6)]
    assert [_devices(a) for a in node.replica_args] == [["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"]]
    shared = NodeReplicas(dataclasses.replace(args, tp=1), info=None, num_cuda_devices=1)
    assert [(a.base_device, a.mem_fraction) for a in shared.replica_args] == [(0, 0.3), (0, 0.3)]
    with pytest.raises(ValueError, match="--dp 2 x --tp 2 needs 4 CUDA devices, 2 visible"):
        NodeReplicas(args, info=None, num_cuda_devices=2)


def test_resolve_refuses_what_the_visible_devices_cannot_hold(monkeypatch):
    import lightllm.server.args as args_module
    from unit_tests.server.test_args import _resolve

    # a host with three GPUs (monkeypatch restores both after the test)
    monkeypatch.setattr(args_module, "_cuda_available", lambda: True)
    monkeypatch.setattr(args_module, "visible_cuda_devices", lambda: 3)
    assert _resolve("--device", "cuda", "--dp", "3").dp == 3
    with pytest.raises(ValueError, match="--dp 2 x --tp 2 needs 4 CUDA devices, 3 visible"):
        _resolve("--device", "cuda", "--dp", "2", "--tp", "2")


def test_replica_args_only_move_the_device_and_memory_share():
    args = _cuda(dp=2, tp=2, mtp_step=2)
    moved = replica_args(args, 1, replica_placement(args, num_devices=4))
    assert dataclasses.replace(moved, base_device=None) == args
