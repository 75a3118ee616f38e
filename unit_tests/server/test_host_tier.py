"""The server's host tier: its size from the flags, created before the engines with its name in their flags,
unlinked when they stop (or when they fail to start), write-through only with several replicas, and the arenas of
killed servers removed at the next start."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from lightllm.cache.host_tier import HostArena
from lightllm.cache.host_tier.arena import MAX_SHARDS, SHM_DIR
from lightllm.server import host_tier
from lightllm.server.args import load_server_args
from lightllm.server.args_checks import check_host_tier_flags
from lightllm.server.host_tier import PREFIX, host_tier_bytes, remove_orphans, start_with_host_tier


def _args(**flags):
    return load_server_args([], device="cpu", **flags)[0]


class _Engine:
    def __init__(self, args):
        self.args, self.stopped = args, False
        # the engines attach by name while the server runs
        self.attached = HostArena.attach(args.host_tier_name)

    def stop(self, timeout_s: float = 10.0) -> None:
        self.stopped = True


def test_size_from_the_flags(monkeypatch):
    assert host_tier_bytes(_args(host_tier_gb=0.5)) == 1 << 29
    assert host_tier_bytes(_args(host_tier_gb=0)) == 0
    assert host_tier_bytes(_args(disable_prefix_cache=True)) == 0

    class Shm:
        f_bavail, f_frsize = 1000, 1 << 20

    monkeypatch.setattr(host_tier.os, "statvfs", lambda path: Shm)
    # auto: 16 GiB, at most half of the free space
    assert host_tier_bytes(_args()) == 500 << 20
    Shm.f_bavail = 1 << 20
    assert host_tier_bytes(_args()) == 16 << 30


@pytest.mark.parametrize("dp", [1, 2])
def test_created_for_the_engines_and_unlinked_at_stop(dp):
    engine = start_with_host_tier(_args(host_tier_gb=0.01, dp=dp), _Engine)
    name = engine.args.host_tier_name
    assert name.startswith(f"{PREFIX}{os.getpid()}-") and os.path.exists(os.path.join(SHM_DIR, name))
    assert engine.attached.write_through == (dp > 1)
    assert engine.arena.capacity_bytes == 10 << 20
    engine.stop()
    assert engine.engine.stopped and not os.path.exists(os.path.join(SHM_DIR, name))


def test_off_leaves_the_flags_alone():
    engine = start_with_host_tier(_args(host_tier_gb=0), lambda args: args)
    assert engine.host_tier_name is None


def test_unlinked_when_the_engines_fail_to_start():
    seen = []

    def fail(args):
        seen.append(args.host_tier_name)
        raise RuntimeError("engine did not start")

    with pytest.raises(RuntimeError, match="did not start"):
        start_with_host_tier(_args(host_tier_gb=0.01), fail)
    assert seen and not os.path.exists(os.path.join(SHM_DIR, seen[0]))


def test_orphans_of_dead_servers_are_removed():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = HostArena.create(f"{PREFIX}{int(dead.stdout)}-test", 1 << 20)
    mine = HostArena.create(f"{PREFIX}{os.getpid()}-test", 1 << 20)
    try:
        assert orphan.name in remove_orphans()
        assert not os.path.exists(os.path.join(SHM_DIR, orphan.name))
        assert os.path.exists(os.path.join(SHM_DIR, mine.name))
    finally:
        mine.unlink()
        orphan.unlink()


def test_bad_flags_are_refused():
    with pytest.raises(ValueError, match="--host_tier_gb must be >= 0"):
        _args(host_tier_gb=-1)
    with pytest.raises(ValueError, match="backs the prefix cache"):
        _args(host_tier_gb=1, disable_prefix_cache=True)


def test_more_ranks_than_an_entry_holds_turn_the_tier_off_or_are_refused():
    args = _args()
    many = dataclasses.replace(args, tp=MAX_SHARDS + 1)
    # auto: off, the server still starts
    assert host_tier_bytes(many) == 0
    assert host_tier_bytes(dataclasses.replace(many, tp=MAX_SHARDS)) > 0
    # asked for: refused with the reason
    with pytest.raises(ValueError, match=f"at most {MAX_SHARDS} tensor-parallel ranks"):
        check_host_tier_flags(dataclasses.replace(many, host_tier_gb=1.0))
    check_host_tier_flags(dataclasses.replace(many, tp=MAX_SHARDS, host_tier_gb=1.0))
