"""`test/benchmark/profile_engine_host.py` on the CPU at tiny size: the per-phase table, and the torch calls per step
by caller outside the model, which name the overlapped verify's device acceptance when MTP steps run at a simulated
acceptance and not in plain decode; with `--host_only` the model does no work."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "test" / "benchmark" / "profile_engine_host.py"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _main():
    spec = importlib.util.spec_from_file_location("profile_engine_host", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.mark.parametrize("mtp", [True, False], ids=["mtp-at-0.7", "plain"])
def test_torch_calls_by_caller(mtp, capsys):
    argv = ["--mode", "replay", "--batch", "2", "--steps", "3", "--by_caller", "40"]
    if mtp:
        argv += ["--mtp_step", "2", "--simulate_acceptance", "0.7"]
    result = _main()(argv)
    out = capsys.readouterr().out
    assert result["step"] > 0 and result["torch_calls"] > 0
    assert "| torch calls per step outside the model:" in out
    # the overlapped verify accepts on the device: its calls are named only when MTP steps ran
    assert ("verify_full_windows_on_device" in out) == mtp


def test_host_only_leaves_the_host_work():
    argv = ["--mode", "replay", "--batch", "4", "--steps", "4", "--mtp_step", "2", "--simulate_acceptance", "0.7"]
    real, stub = _main()(argv), _main()([*argv, "--host_only"])
    # the step still loads its buffers, emits and settles, without the model's layers or the step's graph body
    assert 0 < stub["emit"] and 0 < stub["verify_on_device"] < real["verify_on_device"] / 2
