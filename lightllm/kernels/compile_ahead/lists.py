"""Compile lists on disk: `lists/<device>.json` = `{"target": [backend, arch, warp_size], triton_version: [entry,
...]}`, each entry `{"kernel": "module:qualname", "spec": {...}, "keys": [group key, ...]}` in the order a start-up
first compiled them (the order workers take them in). `target` is the Triton target the list was recorded for: a
GPU kind without a list of its own takes the group from a list of the same target (`entries_for_device`), whose
kernels compile to the same binaries."""

from __future__ import annotations

import json
import os
from pathlib import Path

import triton

LIST_DIR = Path(__file__).parent / "lists"


def list_path(device_name: str, list_dir: Path | None = None) -> Path:
    """The list of a GPU kind, by its file-name-safe device name (`tuned_tables.device_name`), in `list_dir` (default:
    the shipped lists)."""
    return Path(LIST_DIR if list_dir is None else list_dir) / f"{device_name}.json"


# the list's own field beside its Triton versions
TARGET = "target"


def entries_for_device(
    device_name: str, target: list, key: str, list_dir: Path | None = None
) -> tuple[Path, list[dict]]:
    """The list file a device takes group `key` from, and its entries: its own list, or else the first list (by
    name) recorded for the same Triton `target` ([backend, arch, warp_size]) that has the group; (own path, [])
    when none has it."""
    own = list_path(device_name, list_dir)
    entries = read_entries(own, key)
    if entries:
        return own, entries
    for path in sorted(own.parent.glob("*.json")):
        if path != own and json.loads(path.read_text()).get(TARGET) == list(target):
            entries = read_entries(path, key)
            if entries:
                return path, entries
    return own, []


def read_entries(path: str | os.PathLike, key: str) -> list[dict]:
    """The entries of group `key` for this Triton version in the list file `path` ([] when absent)."""
    path = Path(path)
    if not path.is_file():
        return []
    entries = json.loads(path.read_text()).get(triton.__version__, [])
    return [e for e in entries if key in e["keys"]]


def merge_entries(
    path: str | os.PathLike, key: str, recorded: list[dict], replace: bool = False, target: list | None = None
) -> int:
    """Add `recorded` entries (`kernel`, `spec`) to the group `key` of the list file `path` under this Triton
    version: an entry already listed (same kernel and spec) gains the key, a new one is appended. With `replace`
    the group's earlier entries lose the key first (and go when no key is left). `target`: the Triton target they
    were compiled for (a list holds one). Returns the group's size."""
    path = Path(path)
    table = json.loads(path.read_text()) if path.is_file() else {}
    if target is not None:
        if table.get(TARGET, list(target)) != list(target):
            raise ValueError(f"{path} is the list of target {table[TARGET]}, not {list(target)}")
        table[TARGET] = list(target)
    entries = table.get(triton.__version__, [])
    if replace:
        for entry in entries:
            entry["keys"] = [k for k in entry["keys"] if k != key]
    index = {_identity(e): e for e in entries}
    for item in recorded:
        entry = index.get(_identity(item))
        if entry is None:
            entry = index[_identity(item)] = {"kernel": item["kernel"], "spec": item["spec"], "keys": []}
            entries.append(entry)
        if key not in entry["keys"]:
            entry["keys"].append(key)
    table[triton.__version__] = [e for e in entries if e["keys"]]
    path.parent.mkdir(parents=True, exist_ok=True)
    # one entry per line: a recording's diff reads as the variants it added
    fields = [f"{json.dumps(TARGET)}: {json.dumps(table[TARGET])}"] if TARGET in table else []
    fields += [
        f"{json.dumps(version)}: [\n" + ",\n".join(json.dumps(e, separators=(",", ":")) for e in listed) + "\n]"
        for version, listed in table.items()
        if version != TARGET
    ]
    path.write_text("{\n" + ",\n".join(fields) + "\n}\n")
    return sum(key in e["keys"] for e in table[triton.__version__])


def _identity(entry: dict) -> str:
    return entry["kernel"] + json.dumps(entry["spec"], sort_keys=True)
