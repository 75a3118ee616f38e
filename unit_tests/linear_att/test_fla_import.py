"""fla's prefill kernels imported without the package bodies serving never calls (`linear_att.fla_import`), and the
start-up's fla import on a thread of its own (`warmup_steps.start_pin_fla` / `pin_fla`). Imports run in fresh
interpreters: the test process has fla loaded already."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lightllm.worker.startup_phases import StartupPhases
from lightllm.worker.warmup_steps import pin_fla, start_pin_fla

ROOT = Path(__file__).resolve().parents[2]
ENTRY = '("fla.ops.gated_delta_rule", "fla.ops.kda")'
LEAN = f"from lightllm.linear_att.fla_import import import_entry_modules; import_entry_modules({ENTRY})"
PLAIN = "import fla.ops.gated_delta_rule, fla.ops.kda"
# what a process holds after the import, and the public names of the deferred packages once used
REPORT = """
import json, sys
import fla.ops, fla.modules
loaded = {name: name in sys.modules for name in ("fla.ops.abc", "fla.ops.based", "fla.modules.norm.fused_norm_gate")}
from fla.ops import chunk_gla, chunk_gated_delta_rule
from fla.modules import FusedRMSNormGated
same = chunk_gated_delta_rule is sys.modules["fla.ops.gated_delta_rule"].chunk_gated_delta_rule
names = {p: sorted(n for n in dir(sys.modules[p]) if not n.startswith("_")) for p in ("fla.ops", "fla.modules")}
print(json.dumps({"loaded": loaded, "same": same, "names": names}))
"""


def _run(code: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, check=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def lean_and_plain():
    return _run(LEAN + "\n" + REPORT), _run(PLAIN + "\n" + REPORT)


def test_the_lean_import_skips_the_package_bodies(lean_and_plain):
    lean, plain = lean_and_plain
    assert lean["loaded"] == {"fla.ops.abc": False, "fla.ops.based": False, "fla.modules.norm.fused_norm_gate": False}
    # twin: a plain import of the same modules loads every op family and the fused norms
    assert plain["loaded"] == {"fla.ops.abc": True, "fla.ops.based": True, "fla.modules.norm.fused_norm_gate": True}


def test_a_deferred_package_gives_what_a_plain_import_gives_once_used(lean_and_plain):
    lean, plain = lean_and_plain
    assert lean["same"] and plain["same"]
    assert lean["names"] == plain["names"]
    assert "chunk_gla" in lean["names"]["fla.ops"] and "FusedRMSNormGated" in lean["names"]["fla.modules"]


def test_the_lean_import_finds_every_kernel_the_shipped_tables_pin():
    code = """
import json
from lightllm.linear_att.fla_pinning import TABLE_DIR, fla_autotuners
found = set(fla_autotuners())
listed = {k for p in TABLE_DIR.glob("*.json") for k in json.loads(p.read_text())["kernels"]}
print(json.dumps({"listed": sorted(listed), "missing": sorted(listed - found)}))
"""
    result = _run(code)
    assert result["listed"] and result["missing"] == []


# a background import racing the start-up's own: one set of deferred packages, every entry module loaded once
RACE = f"""
import json, sys, threading
from lightllm.linear_att import fla_import
registered = []
original = fla_import._register_deferred
fla_import._register_deferred = lambda name: (registered.append(name), original(name))[1]
background = fla_import.import_in_background({ENTRY})
fla_import.import_entry_modules({ENTRY})
background.join()
ops = sys.modules["fla.ops"]
print(json.dumps({{"registered": registered, "deferred": fla_import.is_deferred(ops),
                   "entry": all(n in sys.modules for n in {ENTRY}), "thread": background.name}}))
"""
BROKEN = """
import json, sys
from lightllm.linear_att import fla_import
thread = fla_import.import_in_background(("fla.ops.no_such_op",))
thread.join()
print(json.dumps({"alive": thread.is_alive(), "loaded": "fla.ops.no_such_op" in sys.modules}))
"""


def test_a_background_import_and_the_start_ups_register_the_packages_once():
    result = _run(RACE)
    assert result == {
        "registered": ["fla.ops", "fla.modules", "fla.modules.norm"],
        "deferred": True,
        "entry": True,
        "thread": "fla-import",
    }


def test_a_failed_background_import_is_left_for_the_next_import_to_raise():
    assert _run(BROKEN) == {"alive": False, "loaded": False}


def _cuda_runner():
    return SimpleNamespace(device=torch.device("cuda"), startup=StartupPhases())


def test_pin_fla_waits_for_the_work_started_on_its_thread():
    runner, pending = _cuda_runner(), Future()
    pending.set_result("pinned")
    pin_fla(runner, pending)
    assert "fla import and pinning" in runner.startup.summary()
    # twin: what failed on the thread fails the start-up
    failed = Future()
    failed.set_exception(RuntimeError("fla import failed"))
    with pytest.raises(RuntimeError, match="fla import failed"):
        pin_fla(_cuda_runner(), failed)


def test_nothing_is_started_off_cuda():
    assert start_pin_fla("cpu") is None
    runner = SimpleNamespace(device=torch.device("cpu"), startup=StartupPhases())
    pin_fla(runner)
    assert "fla" not in runner.startup.summary()


def test_the_lean_import_leaves_torch_compiler_stack_out():
    """fla's `torch.compiler.disable` marks import torch._dynamo (over a second of Python); the lean import leaves
    them as plain functions and puts the decorator back. Twin: the plain import loads the compiler stack."""
    check = (
        "import sys, torch.compiler\n"
        "disable = torch.compiler.disable\n"
        "{import_}\n"
        "from fla.ops.gated_delta_rule import chunk_gated_delta_rule\n"
        "import json\n"
        "print(json.dumps({{'dynamo': 'torch._dynamo' in sys.modules, 'restored': torch.compiler.disable is disable,"
        " 'callable': callable(chunk_gated_delta_rule)}}))\n"
    )
    lean, plain = _run(check.format(import_=LEAN)), _run(check.format(import_=PLAIN))
    assert lean == {"dynamo": False, "restored": True, "callable": True}
    assert plain == {"dynamo": True, "restored": True, "callable": True}
