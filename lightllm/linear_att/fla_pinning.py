"""Pinned launch configurations for fla-core's autotuned kernels, so that no prefill benchmarks configs at start-up.

fla-core 0.6.0 wraps its chunk kernels (those `chunk_gated_delta_rule` and `chunk_kda` launch) in
`triton.autotune`: the first call per tuning key benchmarks every config (tens of seconds to minutes for a model on a
fresh H200). Triton's `Autotuner` looks a key up in its `cache` dict and benchmarks only on a miss. Pinning installs
a `PinnedConfigs` dict there: every key resolves to the table's config for that key, else to the table's default for
the kernel, so the autotuner never benchmarks; the kernel still compiles once per config and specialisation (the
start-up warm-up pays that).

Tables are per GPU kind (`fla_tuned/<device name>.json`, written by `lightllm.tools.tune_fla_configs` on that GPU)
and name the fla-core and Triton versions they were tuned with and the GPU's compute capability (a GPU kind without
a table takes one of the same capability): a table from other versions, a kernel the installed
fla lacks, or a config that kernel does not offer is not pinned (fla autotunes it as before, at the warm-up).
"""

from __future__ import annotations

import json
import logging
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
import triton
from triton.runtime.autotuner import Autotuner
from triton.runtime.jit import KernelInterface

from lightllm.linear_att.fla_import import import_entry_modules

logger = logging.getLogger(__name__)

TABLE_DIR = Path(__file__).parent / "fla_tuned"
# the fla modules whose kernels a prefill reaches (their imports pull in the shared chunk helpers)
FLA_ENTRY_MODULES = ("fla.ops.gated_delta_rule", "fla.ops.kda")


def table_path(device_name: str) -> Path:
    """The shipped table of a GPU kind: its device name with every run of other characters as one underscore."""
    return TABLE_DIR / f"{re.sub(r'[^0-9A-Za-z]+', '_', device_name).strip('_')}.json"


def fla_autotuners(entry_modules: tuple[str, ...] = FLA_ENTRY_MODULES) -> dict[str, Autotuner]:
    """Every autotuned kernel of the loaded `fla` modules as `module:kernel` -> its `Autotuner` (after importing
    `entry_modules`, without the package bodies serving never calls: `fla_import`)."""
    import_entry_modules(entry_modules)
    found: dict[str, Autotuner] = {}
    for module_name, module in list(sys.modules.items()):
        if module is None or not (module_name == "fla" or module_name.startswith("fla.")):
            continue
        for value in list(vars(module).values()):
            tuner = _autotuner_of(value)
            if tuner is not None:
                found.setdefault(f"{tuner.base_fn.__module__}:{tuner.base_fn.__name__}", tuner)
    return found


def _autotuner_of(value) -> Autotuner | None:
    """The `Autotuner` inside a kernel object (`triton.heuristics` wraps it; `.fn` leads inward), else None."""
    for _ in range(4):
        if isinstance(value, Autotuner):
            return value
        if not isinstance(value, KernelInterface):
            return None
        value = getattr(value, "fn", None)
    return None


def config_to_json(config: triton.Config) -> dict:
    return {"kwargs": dict(config.kwargs), "num_warps": config.num_warps, "num_stages": config.num_stages}


def _same(config: triton.Config, entry: dict) -> bool:
    return config_to_json(config) == {
        "kwargs": entry["kwargs"],
        "num_warps": entry["num_warps"],
        "num_stages": entry["num_stages"],
    }


def _key(entry_key) -> tuple:
    """A JSON key (lists) back into the tuple Triton builds (its items are ints, floats, bools, strings)."""
    return tuple(_key(k) if isinstance(k, list) else k for k in entry_key)


def _jsonable(value):
    """A tuning key as JSON: tuples as lists; a value of another type as its repr (it then matches no key and
    that key takes the kernel's default)."""
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


class PinnedConfigs(dict):
    """An autotuner's cache that holds every key: the table's config for a listed key, else `default`."""

    def __init__(self, by_key: dict[tuple, triton.Config], default: triton.Config):
        super().__init__(by_key)
        self.default = default

    def __contains__(self, key) -> bool:
        return True

    def __missing__(self, key) -> triton.Config:
        return self.default


@dataclass
class PinReport:
    """What `pin_fla_configs` did: kernels pinned, and why others were not."""

    pinned: list[str] = field(default_factory=list)
    # table kernels the installed fla lacks, or whose configs it does not offer
    refused: dict[str, str] = field(default_factory=dict)
    # autotuned fla kernels the table does not list (they autotune as before)
    unlisted: list[str] = field(default_factory=list)
    # why nothing was pinned (no table, other versions); None when the table applied
    skipped: str | None = None


def pin_fla_configs(table: dict | None, autotuners: dict[str, Autotuner] | None = None) -> PinReport:
    """Pin the kernels `table` lists (see the module docstring for its checks); `table` None pins nothing."""
    report = PinReport()
    if table is None:
        report.skipped = "no table for this GPU"
        return report
    import fla

    versions = {"fla": fla.__version__, "triton": triton.__version__}
    if table.get("versions") != versions:
        report.skipped = f"table tuned with {table.get('versions')}, installed {versions}"
        return report
    autotuners = fla_autotuners() if autotuners is None else autotuners
    for name, spec in table["kernels"].items():
        tuner = autotuners.get(name)
        if tuner is None:
            report.refused[name] = "not an autotuned kernel of the installed fla"
            continue
        entries = [spec["default"], *(e["config"] for e in spec.get("by_key", []))]
        offered = [[c for c in tuner.configs if _same(c, e)] for e in entries]
        if not all(offered):
            report.refused[name] = "a config the kernel does not offer"
            continue
        by_key = {_key(e["key"]): match[0] for e, match in zip(spec.get("by_key", []), offered[1:])}
        tuner.cache = PinnedConfigs(by_key, offered[0][0])
        report.pinned.append(name)
    report.unlisted = sorted(set(autotuners) - set(table["kernels"]))
    return report


def table_for_device(device_name: str, capability: tuple[int, int] | None) -> tuple[Path, dict | None]:
    """The shipped table of `device_name`, else one tuned on another GPU kind of the same compute capability
    `capability` (the same SM architecture offers the same configs; a config tuned on a sibling beats minutes of
    autotuning at start-up), else (its own path, None)."""
    path = table_path(device_name)
    if path.exists():
        return path, json.loads(path.read_text())
    if capability is not None:
        for sibling in sorted(TABLE_DIR.glob("*.json")):
            table = json.loads(sibling.read_text())
            if table.get("capability") == list(capability):
                return sibling, table
    return path, None


def pin_for_device(device_name: str, capability: tuple[int, int] | None = None) -> PinReport:
    """Pin from the shipped table of `device_name` or of a GPU kind of the same compute capability (nothing when
    there is none); logs what it did."""
    path, table = table_for_device(device_name, capability)
    report = pin_fla_configs(table)
    if report.skipped:
        logger.info("fla kernels autotune at the warm-up (%s: %s)", path.name, report.skipped)
        return report
    sibling = "" if path == table_path(device_name) else f", tuned on another GPU of compute capability {capability}"
    logger.info(
        "fla kernels pinned from %s%s: %d (%d autotune)", path.name, sibling, len(report.pinned), len(report.unlisted)
    )
    for name, why in report.refused.items():
        logger.warning("fla kernel %s not pinned: %s", name, why)
    return report


def record_table(autotuners: dict[str, Autotuner]) -> dict:
    """The table of what `autotuners` chose so far (after a warm-up with autotuning on): every key they met, and
    per kernel the config chosen for the most keys as the default for keys the warm-up did not meet."""
    import fla

    kernels = {}
    for name, tuner in sorted(autotuners.items()):
        chosen = {key: config for key, config in dict(tuner.cache).items()}
        if not chosen:
            continue
        counts = Counter(json.dumps(config_to_json(c), sort_keys=True) for c in chosen.values())
        kernels[name] = {
            "default": json.loads(counts.most_common(1)[0][0]),
            "by_key": [{"key": _jsonable(key), "config": config_to_json(c)} for key, c in chosen.items()],
        }
    table = {"versions": {"fla": fla.__version__, "triton": triton.__version__}, "kernels": kernels}
    if torch.cuda.is_available():
        table["capability"] = list(torch.cuda.get_device_capability())
    return table
