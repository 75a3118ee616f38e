"""Decode-kernel autotuning at start-up, for a serving shape the shipped tables do not hold.

The launch configuration of a decode / verify kernel is looked up per shape (`autotune.TuneKey`). A shape outside the
shipped tables (`gdn/tuned/`, `kda/tuned/`) would launch with the untuned default; `tune_serving_shape` instead
times the candidates once, on scratch buffers it allocates (never the serving state), and adds the winners to the
algorithm's table (`Algorithm.table`, which every launch of that algorithm looks its configuration up in). It must run before any CUDA graph is captured: a graph keeps the configuration it was captured with.
`ModelRunner.warmup` calls it next to the prefill warm-up.

Results are cached on disk, one JSON table per GPU model and Triton version (`cache_path`); every entry's key also
holds the dtypes, head counts and dims, gate width, verify width, replay replay_capacity and projection, and KDA's gate
lower bound, so a later start of the same shape reads the cache and times nothing.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from lightllm.linear_att import autotune, tuning

logger = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = Path.home() / ".cache" / "lightllm" / "linear_att_tuned"


def cache_path(cache_dir: str | Path, device) -> Path:
    """The cache file of one GPU model and Triton version."""
    gpu = re.sub(r"[^A-Za-z0-9_.-]+", "_", autotune.device_name(device))
    return Path(cache_dir) / f"{gpu}__triton-{autotune.triton_version()}.json"


def serving_case(state, spec) -> tuning.TuneCase:
    """The tuning case of a serving state: its heads, dims, dtypes, verify width, replay replay_capacity and gate."""
    config = state.config
    return tuning.TuneCase(
        spec.algo,
        spec.num_k_heads,
        spec.num_v_heads,
        spec.head_k_dim,
        spec.head_v_dim,
        config.state_dtype,
        config.act_dtype,
        state.max_width,
        config.replay_capacity,
        spec.gate_lower_bound,
    )


def needed_keys(state, spec) -> list[autotune.TuneKey]:
    """The keys the state's decode path looks up: native's verify ("serial"), compact's ("compact"), or replay's
    verify in its projection. Replay's standalone fold is not timed here: it runs only before a prefill chunk and
    for an export (every decode step folds inside its verify kernel), moving a few rows' states where a step reads
    them all, so its launch takes the table's nearest entry or the default (which compiles for sm_90 with 72-96
    registers and no spills at the served heads) instead of costing every fresh start a search."""
    serial, compact, inline, precompute, _fold = tuning.case_keys(serving_case(state, spec), state.device)
    mode = getattr(state.config.mode, "value", state.config.mode)
    if mode == "replay":
        return [inline if state.config.projection == "inline" else precompute]
    return [compact] if mode == "compact" else [serial]


def _held(table: autotune.ConfigTable, key: autotune.TuneKey) -> bool:
    """Whether the table answers `key` with a tuned entry: its own, or for compact the serial entry of the same
    shape, which compact borrows (native's tile, under which compact equals native bitwise)."""
    if table.get(key) is not None:
        return True
    return key.family == "compact" and table.get(replace(key, family="serial")) is not None


def uses_triton(state) -> bool:
    return state.backend == "triton" or (state.backend is None and state.device.type == "cuda")


def tune_serving_shape(
    state,
    spec,
    *,
    cache_dir: str | Path | None = None,
    progress: bool = True,
    num_rows: int | None = None,
    configs: list[autotune.KernelConfig] | None = None,
    algorithm=None,
) -> list[autotune.TuneKey]:
    """Tune the keys of `needed_keys` that neither the shipped tables nor the cache hold; returns them.

    state / spec: the serving `LinearAttState` and its `LinearAttSpec` (only shapes, dtypes, mode and device are
    read; no state tensor is touched). cache_dir: the on-disk cache (default `DEFAULT_CACHE_DIR`). num_rows: rows
    of the timed scratch step (default: the state's request slots, at most 256). configs: replaces the search space.
    algorithm: the `Algorithm` whose table gets the entries (default: the spec's).
    A state on the torch path has nothing to tune. Blocks until the device is done.
    """
    if not uses_triton(state):
        return []
    table = (algorithm or spec.algorithm).table
    path = cache_path(cache_dir or DEFAULT_CACHE_DIR, state.device)
    cached = _read_cache(path)
    table.update(cached)
    missing = [key for key in needed_keys(state, spec) if not _held(table, key)]
    if not missing:
        return []
    rows = num_rows or max(1, min(256, state.config.max_requests))
    with (
        torch.no_grad(),
        tqdm(total=len(missing), desc="decode kernel autotune", unit="kernel", disable=not progress) as bar,
    ):
        found, _ = tuning.tune(
            [serving_case(state, spec)],
            num_rows=rows,
            device=state.device,
            log=lambda _: None,
            configs=configs,
            only=set(missing),
            on_done=lambda _: bar.update(),
        )
    if state.device.type == "cuda":
        torch.cuda.synchronize(state.device)
    # re-read: another rank of a tensor-parallel group may have added its shapes meanwhile
    cached = _read_cache(path)
    cached.update(found)
    # written whole under a private name, then renamed: a concurrent reader sees the old file or the new one
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    cached.save(tmp)
    os.replace(tmp, path)
    table.update(found)
    return missing


def _read_cache(path: Path) -> autotune.ConfigTable:
    """The cached table, or an empty one when there is none or it cannot be read (it is then rewritten)."""
    if not path.exists():
        return autotune.ConfigTable()
    try:
        return autotune.ConfigTable.load(path)
    except (OSError, ValueError, KeyError) as err:
        logger.warning("ignoring the unreadable autotune cache %s: %s", path, err)
        return autotune.ConfigTable()
