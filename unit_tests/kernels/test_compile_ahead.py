"""Compile lists: kernel variants recorded from real sm_90 compiles on the CPU, compiled again by worker processes
into an empty Triton cache, after which the same launches compile nothing (every one a cache hit); a list whose
constexprs no longer match leaves the launches to compile. Lists merge by group; the engine's group key ignores
depth and vocabulary and follows dtype, TP size and quantization."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from lightllm.kernels.compile_ahead.lists import entries_for_device, merge_entries, read_entries
from unit_tests.helpers.sm90 import PTXAS

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _child(mode: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run(
        [sys.executable, "-m", "unit_tests.helpers.compile_ahead_child", mode],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


@pytest.mark.skipif(not os.path.exists(PTXAS), reason="Triton's bundled ptxas is not installed")
def test_workers_fill_the_cache_the_launches_then_hit():
    result = _child("match")
    assert result["entries"] == 3 and result["refused"] == {}
    assert result["compiled"] == 3 and result["failed"] == [] and result["unfinished"] == 0
    assert result["files_from_workers"] > 0
    assert result["files_added_by_launches"] == 0 and result["compiled_since_wait"] == 0
    assert result["second_start"] == [0, True]


@pytest.mark.skipif(not os.path.exists(PTXAS), reason="Triton's bundled ptxas is not installed")
def test_a_stale_list_leaves_the_launches_to_compile():
    result = _child("stale")
    assert result["compiled"] == 3
    assert result["files_added_by_launches"] > 0 and result["compiled_since_wait"] == 1  # the RMSNorm variant


def _entry(kernel: str, value: int) -> dict:
    return {
        "kernel": kernel,
        "spec": {"signature": {"x": "*fp32"}, "constants": [[[1], value]], "attrs": [], "options": {}},
    }


def test_lists_merge_by_group(tmp_path):
    path = tmp_path / "NVIDIA_H200.json"
    assert read_entries(path, "a") == []
    assert merge_entries(path, "a", [_entry("m:k", 1), _entry("m:k", 2)]) == 2
    assert merge_entries(path, "b", [_entry("m:k", 2), _entry("m:j", 1)]) == 2
    assert [e["spec"]["constants"][0][1] for e in read_entries(path, "a")] == [1, 2]
    assert [(e["kernel"], e["keys"]) for e in read_entries(path, "b")] == [("m:k", ["a", "b"]), ("m:j", ["b"])]
    # additive unless replaced; a replaced group keeps only what the new recording met
    assert merge_entries(path, "a", [_entry("m:j", 1)]) == 3
    assert merge_entries(path, "a", [_entry("m:j", 1)], replace=True) == 1
    assert [e["kernel"] for e in read_entries(path, "a")] == ["m:j"]
    (listed,) = json.loads(path.read_text()).values()
    assert len(listed) == 2  # m:k with 1 had group a only: it went
    assert len(path.read_text().splitlines()) == 4 + len(listed)  # one line per entry


def test_a_gpu_without_a_list_takes_one_of_its_target(tmp_path):
    """A list records its Triton target; a GPU kind without a list of its own takes the group from a list of the
    same target (the same binaries), never from another target's or from a list without the group."""
    sm90, sm80 = ["cuda", 90, 32], ["cuda", 80, 32]
    merge_entries(tmp_path / "GPU_A.json", "g", [_entry("m:k", 1)], target=sm90)
    merge_entries(tmp_path / "GPU_C.json", "g", [_entry("m:k", 3)], target=sm80)
    merge_entries(tmp_path / "GPU_D.json", "other", [_entry("m:k", 4)], target=sm90)
    assert json.loads((tmp_path / "GPU_A.json").read_text())["target"] == sm90
    path, entries = entries_for_device("GPU_B", sm90, "g", tmp_path)
    assert path.name == "GPU_A.json" and [e["spec"]["constants"][0][1] for e in entries] == [1]
    # twin: another target finds its own list only
    path, entries = entries_for_device("GPU_B", sm80, "g", tmp_path)
    assert path.name == "GPU_C.json" and [e["spec"]["constants"][0][1] for e in entries] == [3]
    assert entries_for_device("GPU_B", ["cuda", 100, 32], "g", tmp_path)[1] == []
    # a list of its own comes first; a list keeps its one target
    merge_entries(tmp_path / "GPU_B.json", "g", [_entry("m:k", 2)], target=sm90)
    assert entries_for_device("GPU_B", sm90, "g", tmp_path)[0].name == "GPU_B.json"
    with pytest.raises(ValueError, match="target"):
        merge_entries(tmp_path / "GPU_B.json", "g", [_entry("m:k", 2)], target=sm80)


def test_the_shipped_lists_name_their_target():
    from lightllm.kernels.compile_ahead.lists import LIST_DIR

    lists = sorted(LIST_DIR.glob("*.json"))
    assert lists and all(json.loads(p.read_text())["target"][0] == "cuda" for p in lists)


def test_group_key_follows_what_reaches_kernels():
    from lightllm.models.registry import load_model_config
    from lightllm.tools.make_tiny_model import tiny_model_dir
    from lightllm.worker.compile_ahead import group_key

    cfg = load_model_config(tiny_model_dir("qwen3_5"))
    key = group_key(cfg, torch.bfloat16, 1, None)
    assert key.startswith("qwen3_5/h") and "/bfloat16/tp1/none-" in key
    deeper = dataclasses.replace(cfg, layer_types=cfg.layer_types * 2, ffn_types=cfg.ffn_types * 2, vocab_size=7)
    assert group_key(deeper, torch.bfloat16, 1, None) == key
    assert group_key(cfg, torch.float16, 1, None) != key
    assert group_key(cfg, torch.bfloat16, 2, None) != key
    assert group_key(cfg, torch.bfloat16, 1, "fp8") != key
    wider = dataclasses.replace(cfg, intermediate_size=cfg.intermediate_size * 2)
    assert group_key(wider, torch.bfloat16, 1, None) != key
    heads = dataclasses.replace(cfg, linear=dataclasses.replace(cfg.linear, num_v_heads=cfg.linear.num_v_heads * 2))
    assert group_key(heads, torch.bfloat16, 1, None) != key


def test_an_entry_that_does_not_compile_is_reported_and_the_rest_go_on(tmp_path, monkeypatch):
    from triton.backends.compiler import GPUTarget

    from lightllm.kernels.compile_ahead.pool import CompileAhead

    spec = {"signature": {"x": "*fp32"}, "constants": [], "attrs": [], "options": {}}
    entries = [{"kernel": "lightllm.kernels.no_such_module:kernel", "spec": spec}]
    entries.append({"kernel": "lightllm.kernels.host_flag:no_such_kernel", "spec": spec})
    # an empty cache of its own: a marker left in a shared one by an earlier run would start no worker
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    report = CompileAhead(entries, GPUTarget("cuda", 90, 32), workers=1).wait(120)
    assert report.compiled == 0 and report.unfinished == 0 and not report.cached
    assert report.failed == [e["kernel"] for e in entries]
    assert "0 of 2 kernels compiled ahead on 1 processes" in report.summary() and "no_such_kernel" in report.summary()
    # the failures are final: the same entries on the same cache start no worker again
    again = CompileAhead(entries, GPUTarget("cuda", 90, 32), workers=1)
    assert again.workers == 0 and again.wait(120).cached


def _claims(claims_dir: str, count: int, out) -> None:
    from lightllm.kernels.compile_ahead.worker import claim

    out.put([i for i in range(count) if claim(claims_dir, i)])


@pytest.mark.parametrize("shared", [True, False])
def test_workers_claim_each_entry_once(tmp_path, shared):
    """Workers racing over a job's entries: each entry is claimed by exactly one of them. Twin: workers that do not
    share the claims folder both take every entry."""
    import multiprocessing as mp

    ctx, count = mp.get_context("fork"), 300
    out = ctx.Queue()
    dirs = [tmp_path / "claims"] * 2 if shared else [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir(exist_ok=True)
    procs = [ctx.Process(target=_claims, args=(str(d), count, out)) for d in dirs]
    for p in procs:
        p.start()
    taken = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(60)
    both = set(taken[0]) & set(taken[1])
    assert sorted(taken[0] + taken[1]) == list(range(count)) if shared else both == set(range(count))
