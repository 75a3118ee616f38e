"""Pinned configs for fla's autotuned kernels (`linear_att.fla_pinning`): a pinned autotuner never benchmarks, runs
the table's config for a listed key and the kernel's default for any other, and computes the same values; tables
from other versions, unknown kernels and configs a kernel does not offer pin nothing; a recorded table pins what
was chosen; the collector finds the chunk kernels fla's gated delta rule and KDA prefills launch."""

from __future__ import annotations

import json

import fla
import pytest
import torch
import triton
import triton.language as tl

from lightllm.linear_att import fla_pinning
from lightllm.linear_att.fla_pinning import (
    PinnedConfigs,
    config_to_json,
    fla_autotuners,
    pin_fla_configs,
    record_table,
    table_path,
)

CONFIGS = [triton.Config({"BLOCK": 16}, num_warps=1, num_stages=1), triton.Config({"BLOCK": 32}, num_warps=2)]
VERSIONS = {"fla": fla.__version__, "triton": triton.__version__}
NAME = "tests:double_kernel"


@triton.autotune(configs=CONFIGS, key=["N"])
@triton.jit
def double_kernel(x, y, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    tl.store(y + offs, tl.load(x + offs, mask=mask, other=0.0) * 2.0, mask=mask)


@pytest.fixture
def tuner(monkeypatch):
    """The test kernel's autotuner with an empty cache; benchmarks are counted (and never timed)."""
    benched = []
    monkeypatch.setattr(double_kernel, "cache", {})
    monkeypatch.setattr(double_kernel, "_bench", lambda *a, config, **k: benched.append(config) or [1.0, 1.0, 1.0])
    double_kernel.benched = benched
    return double_kernel


def _run(n: int) -> dict:
    x = torch.randn(n)
    y = torch.full((n,), float("nan"))
    double_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](x, y, n)
    torch.testing.assert_close(y, 2 * x)
    return config_to_json(double_kernel.best_config)


def _table(default: triton.Config, by_key: list[tuple[tuple, triton.Config]] = (), versions=VERSIONS) -> dict:
    spec = {
        "default": config_to_json(default),
        "by_key": [{"key": list(k), "config": config_to_json(c)} for k, c in by_key],
    }
    return {"versions": versions, "kernels": {NAME: spec}}


def test_pinned_kernel_runs_the_table_config_without_benchmarking(tuner):
    key_40 = (40, "torch.float32", "torch.float32")
    report = pin_fla_configs(_table(CONFIGS[1], [(key_40, CONFIGS[0])]), {NAME: tuner})
    assert report.pinned == [NAME] and report.refused == {} and report.skipped is None
    assert isinstance(tuner.cache, PinnedConfigs)
    assert _run(40) == config_to_json(CONFIGS[0])
    # a key the table does not list takes the kernel's default
    assert _run(77) == config_to_json(CONFIGS[1])
    assert tuner.benched == []


def test_unpinned_kernel_benchmarks_every_config(tuner):
    # the twin: without a table the first call per key benchmarks both configs
    report = pin_fla_configs(None, {NAME: tuner})
    assert report.skipped == "no table for this GPU" and not isinstance(tuner.cache, PinnedConfigs)
    _run(40)
    assert len(tuner.benched) == 2


@pytest.mark.parametrize(
    "table, reason",
    [
        (_table(CONFIGS[0], versions={"fla": "0.0.1", "triton": triton.__version__}), "table tuned with"),
        (_table(triton.Config({"BLOCK": 64}, num_warps=4)), "a config the kernel does not offer"),
        ({"versions": VERSIONS, "kernels": {"tests:other_kernel": _table(CONFIGS[0])["kernels"][NAME]}}, "not an"),
    ],
    ids=["other-versions", "config-not-offered", "unknown-kernel"],
)
def test_table_that_does_not_fit_pins_nothing(tuner, table, reason):
    report = pin_fla_configs(table, {NAME: tuner})
    assert report.pinned == [] and not isinstance(tuner.cache, PinnedConfigs)
    assert reason in (report.skipped or "") + " ".join(report.refused.values())


def test_recorded_table_pins_what_was_chosen(tuner):
    tuner.cache = {
        (40, "torch.float32", "torch.float32"): CONFIGS[0],
        (8, "torch.float32", "torch.float32"): CONFIGS[1],
    }
    tuner.cache[(9, "torch.float32", "torch.float32")] = CONFIGS[1]
    table = record_table({NAME: tuner})
    assert table["versions"] == VERSIONS
    assert table["kernels"][NAME]["default"] == config_to_json(CONFIGS[1])
    tuner.cache = {}
    assert pin_fla_configs(table, {NAME: tuner}).pinned == [NAME]
    assert (_run(40), _run(8), _run(123)) == tuple(config_to_json(c) for c in (CONFIGS[0], CONFIGS[1], CONFIGS[1]))
    assert tuner.benched == []


def test_collector_finds_the_prefill_chunk_kernels():
    tuners = fla_autotuners()
    for name in (
        "fla.ops.common.chunk_o:chunk_fwd_kernel_o",
        "fla.ops.common.chunk_delta_h:chunk_gated_delta_rule_fwd_kernel_h_blockdim64",
        "fla.ops.common.chunk_scaled_dot_kkt:chunk_scaled_dot_kkt_fwd_kernel",
        "fla.ops.gated_delta_rule.wy_fast:recompute_w_u_fwd_kernel",
    ):
        assert name in tuners and len(tuners[name].configs) >= 1


def test_table_path_names_the_gpu_kind():
    assert table_path("NVIDIA H200").name == "NVIDIA_H200.json"
    assert table_path("NVIDIA H100 80GB HBM3").name == "NVIDIA_H100_80GB_HBM3.json"


def test_pin_for_device_reads_the_shipped_table_of_the_gpu_kind(tmp_path, monkeypatch):
    name = "fla.ops.common.chunk_o:chunk_fwd_kernel_o"
    tuner = fla_autotuners()[name]
    monkeypatch.setattr(tuner, "cache", {})
    monkeypatch.setattr(fla_pinning, "TABLE_DIR", tmp_path)
    assert fla_pinning.pin_for_device("Fake GPU").skipped == "no table for this GPU"
    table = {"versions": VERSIONS, "kernels": {name: {"default": config_to_json(tuner.configs[-1]), "by_key": []}}}
    (tmp_path / "Fake_GPU.json").write_text(json.dumps(table))
    report = fla_pinning.pin_for_device("Fake GPU")
    assert report.pinned == [name] and name not in report.unlisted and report.unlisted
    assert tuner.cache[("any", "key")] is tuner.configs[-1]


def test_a_gpu_kind_without_a_table_takes_one_of_the_same_compute_capability(tmp_path, monkeypatch):
    name = "fla.ops.common.chunk_o:chunk_fwd_kernel_o"
    tuner = fla_autotuners()[name]
    monkeypatch.setattr(tuner, "cache", {})
    monkeypatch.setattr(fla_pinning, "TABLE_DIR", tmp_path)
    sibling = {"default": config_to_json(tuner.configs[-1]), "by_key": []}
    other = {"default": config_to_json(tuner.configs[0]), "by_key": []}
    for file, capability, spec in (("Sibling_GPU.json", [9, 0], sibling), ("Older_GPU.json", [8, 0], other)):
        table = {"versions": VERSIONS, "capability": capability, "kernels": {name: spec}}
        (tmp_path / file).write_text(json.dumps(table))
    # another architecture, or no capability given: no table, fla autotunes
    assert fla_pinning.pin_for_device("Fake GPU", (8, 9)).skipped == "no table for this GPU"
    assert fla_pinning.pin_for_device("Fake GPU").skipped == "no table for this GPU"
    assert tuner.cache == {}
    report = fla_pinning.pin_for_device("Fake GPU", (9, 0))
    assert report.pinned == [name] and tuner.cache[("any", "key")] is tuner.configs[-1]
    # a table of its own wins over a sibling's
    own = {"versions": VERSIONS, "kernels": {name: other}}
    (tmp_path / "Fake_GPU.json").write_text(json.dumps(own))
    fla_pinning.pin_for_device("Fake GPU", (9, 0))
    assert tuner.cache[("any", "key")] is tuner.configs[0]


def test_the_shipped_h200_table_names_its_compute_capability():
    path, table = fla_pinning.table_for_device("NVIDIA H100 80GB HBM3", (9, 0))
    assert path.name == "NVIDIA_H200.json" and table["capability"] == [9, 0]
