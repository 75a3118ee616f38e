"""The offline `LLM` lets go: `close()`, `with LLM(...)` and garbage collection release the runner, and with
`tp=2` (CPU, gloo) the follower process and the process group, so a second `LLM` works in the same process;
a follower never outlives its parent, and a `tp=2` process that exits without closing exits cleanly."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import time
import weakref

import pytest
import torch.distributed as dist

from lightllm import LLM, SamplingParams
from lightllm.server import llm_lifecycle
from lightllm.server.engine_process import GIL_SWITCH_S
from lightllm.tools.make_tiny_model import tiny_model_dir
from lightllm.worker.runner import ModelRunner
from lightllm.worker.tp import group as group_module
from lightllm.worker.tp.group import RankSetup, join_group
from unit_tests.server.live_server import single_threaded_env

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = [5, 6, 7, 8, 9, 31, 7]
FLAGS = {"device": "cpu", "max_total_token_num": 1024}
# after rank 0 is killed: the kernel's parent-death signal ends the follower at once; allow for a busy machine
ORPHAN_DEADLINE_S = 10.0


def model() -> str:
    return str(tiny_model_dir("qwen3_next"))


def follower_pids(parent: int) -> list[int]:
    """Live tensor-parallel followers whose parent is `parent` (zombies excluded; other children of the test
    process, such as multiprocessing's resource tracker started by earlier tests, are not followers)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read()
        except OSError:
            continue
        if int(fields[1]) == parent and fields[0] != "Z" and b"lightllm.server.tp_follower" in command:
            pids.append(int(entry))
    return pids


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def tokens(llm: LLM) -> list[int]:
    return llm.generate([PROMPT], PARAMS)[0].outputs[0].token_ids


def live_runners() -> int:
    gc.collect()
    return sum(isinstance(o, ModelRunner) for o in gc.get_objects())


@pytest.fixture(scope="module")
def expected() -> list[int]:
    """Greedy tokens of a cold tp=1 engine."""
    with LLM(model(), **FLAGS) as llm:
        return tokens(llm)


def test_close_releases_the_runner_and_a_second_llm_matches(expected):
    # Python's default interval (engines built earlier in this process leave the engine's)
    threshold, switch = gc.get_threshold(), 0.005
    sys.setswitchinterval(switch)
    llm = LLM(model(), **FLAGS)
    runner = weakref.ref(llm.engine.runner)
    assert tokens(llm) == expected
    assert gc.get_freeze_count() > 0
    # the engine's short GIL switch interval (its mask thread), the process's own again once it is closed
    assert sys.getswitchinterval() == pytest.approx(GIL_SWITCH_S)
    llm.close()
    assert runner() is None and llm.closed
    # the collector is as it was: nothing left frozen, the thresholds put back
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == threshold
    assert sys.getswitchinterval() == switch
    llm.close()
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate([PROMPT], PARAMS)
    with LLM(model(), **FLAGS) as again:
        runner = weakref.ref(again.engine.runner)
        assert tokens(again) == expected
    assert runner() is None


def test_the_runner_is_unreachable_when_the_device_cache_is_emptied(monkeypatch):
    """Memory goes back to the driver (`release_device_cache`: torch.cuda.empty_cache on a GPU) only if the runner
    is gone by then: a runner still referenced at that moment, freed a moment later, leaves its KV cache and pools
    in the caching allocator after close(), and the next engine sizes its KV cache from what remains."""
    llm = LLM(model(), **FLAGS)
    runner = weakref.ref(llm.engine.runner)
    alive_when_emptied = []
    monkeypatch.setattr(llm_lifecycle, "release_device_cache", lambda: alive_when_emptied.append(runner() is not None))
    llm.close()
    assert alive_when_emptied == [False] and runner() is None


def test_garbage_collection_releases_the_engine():
    llm = LLM(model(), **FLAGS)
    runner = weakref.ref(llm.engine.runner)
    kept = llm
    del llm
    gc.collect()
    # the twin: while a reference lives, the engine must stay
    assert runner() is not None and not kept.closed
    del kept
    assert runner() is None


def test_repeated_create_close_does_not_leak():
    fds, threads = [], []
    for _ in range(3):
        with LLM(model(), **FLAGS) as llm:
            tokens(llm)
        assert live_runners() == 0
        fds.append(len(os.listdir("/proc/self/fd")))
        threads.append(len(os.listdir("/proc/self/task")))
    assert fds[2] <= fds[0] and threads[2] <= threads[0], (fds, threads)


def test_tp2_twice_in_one_process_leaves_no_process_or_group(expected):
    for attempt in range(2):
        with LLM(model(), tp=2, **FLAGS) as llm:
            followers = follower_pids(os.getpid())
            assert len(followers) == 1
            assert tokens(llm) == expected
            if attempt == 0:
                # while this group is open another one is refused, before starting any follower
                with pytest.raises(RuntimeError, match="close that one first"):
                    LLM(model(), tp=2, **FLAGS)
                assert follower_pids(os.getpid()) == followers
        assert follower_pids(os.getpid()) == [] and not any(alive(p) for p in followers)
        assert not dist.is_initialized()


def test_rank0_failing_to_join_kills_its_followers(monkeypatch):
    def refuse(setup):
        raise RuntimeError("rank 0 could not join")

    monkeypatch.setattr(group_module, "join_group", refuse)
    with pytest.raises(RuntimeError, match="rank 0 could not join"):
        group_module.TPGroup(2, "cpu", num_threads=1)
    assert follower_pids(os.getpid()) == []


def test_a_tp_runner_that_fails_to_build_leaves_no_group(monkeypatch, expected):
    """Rank 0's runner failing after the followers joined: the group is shut down, and the next tp=2 LLM opens."""
    from lightllm.server import runner_factory

    def fail(*args, **kwargs):
        raise RuntimeError("rank 0's runner failed to build")

    with monkeypatch.context() as patched:
        patched.setattr(runner_factory, "build_rank_runner", fail)
        with pytest.raises(RuntimeError, match="failed to build"):
            LLM(model(), tp=2, **FLAGS)
    assert follower_pids(os.getpid()) == [] and not dist.is_initialized()
    with LLM(model(), tp=2, **FLAGS) as llm:
        assert tokens(llm) == expected


def test_follower_of_an_exited_parent_does_not_wait():
    setup = RankSetup(1, 2, "tcp://127.0.0.1:1", "gloo", parent_pid=os.getppid() + 10**7)
    with pytest.raises(RuntimeError, match="exited before rank 1 started"):
        join_group(setup)


def _run(script: str, timeout: float = 240) -> subprocess.CompletedProcess:
    code = textwrap.dedent(script).replace("@MODEL@", model())
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=single_threaded_env()
    )


CHILD_PIDS = f"""
import os
from lightllm import LLM, SamplingParams
from lightllm.server import llm_lifecycle
from lightllm.server.engine_process import GIL_SWITCH_S

def followers():
    out = []
    for e in os.listdir("/proc"):
        if e.isdigit():
            try:
                if int(open(f"/proc/{{e}}/stat").read().rsplit(")", 1)[1].split()[1]) == os.getpid():
                    out.append(e)
            except OSError:
                pass
    return out

llm = LLM("@MODEL@", tp=2, device="cpu", max_total_token_num=1024)
params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
print("tokens", *llm.generate([{PROMPT}], params)[0].outputs[0].token_ids)
print("followers", *followers(), flush=True)
"""


def _followers(stdout: str) -> list[int]:
    line = next(x for x in stdout.splitlines() if x.startswith("followers"))
    return [int(p) for p in line.split()[1:]]


def test_follower_dies_with_a_killed_parent():
    proc = _run(CHILD_PIDS + "os.kill(os.getpid(), 9)\n")
    assert proc.returncode == -9, proc.stderr
    followers = _followers(proc.stdout)
    assert len(followers) == 1
    deadline = time.monotonic() + ORPHAN_DEADLINE_S
    while any(alive(p) for p in followers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in followers)


def test_tp2_process_exits_cleanly_without_close(expected):
    proc = _run(CHILD_PIDS)
    assert proc.returncode == 0, proc.stderr
    assert "terminate called" not in proc.stderr
    assert f"tokens {' '.join(map(str, expected))}" in proc.stdout
    assert not any(alive(p) for p in _followers(proc.stdout))
