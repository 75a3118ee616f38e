"""Compile lists on disk: `lists/<device>.json` = `{triton_version: [entry, ...]}`, each entry
`{"kernel": "module:qualname", "spec": {...}, "keys": [group key, ...]}` in the order a start-up first compiled
them (the order workers take them in)."""

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


def read_entries(path: str | os.PathLike, key: str) -> list[dict]:
    """The entries of group `key` for this Triton version in the list file `path` ([] when absent)."""
    path = Path(path)
    if not path.is_file():
        return []
    entries = json.loads(path.read_text()).get(triton.__version__, [])
    return [e for e in entries if key in e["keys"]]


def merge_entries(path: str | os.PathLike, key: str, recorded: list[dict], replace: bool = False) -> int:
    """Add `recorded` entries (`kernel`, `spec`) to the group `key` of the list file `path` under this Triton
    version: an entry already listed (same kernel and spec) gains the key, a new one is appended. With `replace`
    the group's earlier entries lose the key first (and go when no key is left). Returns the group's size."""
    path = Path(path)
    table = json.loads(path.read_text()) if path.is_file() else {}
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
    versions = [
        f"{json.dumps(version)}: [\n" + ",\n".join(json.dumps(e, separators=(",", ":")) for e in listed) + "\n]"
        for version, listed in table.items()
    ]
    path.write_text("{\n" + ",\n".join(versions) + "\n}\n")
    return sum(key in e["keys"] for e in table[triton.__version__])


def _identity(entry: dict) -> str:
    return entry["kernel"] + json.dumps(entry["spec"], sort_keys=True)
