"""docs/metrics.md lists exactly the Prometheus series `/metrics` serves, each with its type and labels: the
front-end's (with several HTTP processes), the engine snapshot's (with its optional series), the progress watchdog's
and the data-parallel replicas'."""

from __future__ import annotations

import os
import re
from pathlib import Path
from types import SimpleNamespace

from lightllm.engine.messages import EngineStats
from lightllm.server.dp.replica_metrics import ReplicaCollector
from lightllm.server.http.metric_rows import MetricRows
from lightllm.server.http.metrics import Metrics
from lightllm.server.http.watchdog import ProgressWatchdog

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
# | `lightllm_name{label,label}` | type | meaning |
ROW = re.compile(r"^\| `(lightllm_\w+)(?:\{([\w,]+)\})?` \| (\w+) \|", re.MULTILINE)


def documented(doc: str) -> dict[str, tuple[str, str]]:
    """Series name -> (type, its labels joined by commas) of every table row of `doc`."""
    return {name: (kind, labels) for name, labels, kind in ROW.findall(doc)}


def _replica_client(stats: EngineStats):
    """One live data-parallel replica reporting `stats`, as `replica_rows` reads a `ReplicaClient`."""
    restarter = SimpleNamespace(restarting=set(), num_restarts=[0])
    replicas = SimpleNamespace(restarter=restarter, handles=[SimpleNamespace(process=SimpleNamespace(pid=1))])
    engine = SimpleNamespace(stats=stats, num_in_flight=1)
    return SimpleNamespace(replicas=replicas, clients=[engine], alive=[True], num_routed=[1])


def served() -> dict[str, tuple[str, str]]:
    """Series name (`_total` on counters, as exposed) -> (type, labels) of every family a server with two HTTP
    processes, a replay engine that drafted and one data-parallel replica registers."""
    stats = EngineStats(accepted_length_counts=[1, 2], state_pool_bytes={"replay": 1}, num_folds=1)
    path = MetricRows.create_file(Metrics.WIDTH, 2)
    try:
        metrics = Metrics(lambda: stats, MetricRows(Metrics.WIDTH, 2, 0, path))
        ProgressWatchdog(1.0, metrics.in_flight, lambda: stats, metrics.registry)
        client = _replica_client(stats)
        metrics.registry.register(ReplicaCollector(lambda: client))
        families = list(metrics.registry.collect())
    finally:
        os.remove(path)
    return {
        family.name + ("_total" if family.type == "counter" else ""): (
            family.type,
            ",".join(sorted({k for s in family.samples for k in s.labels if k != "le"})),
        )
        for family in families
    }


def test_metrics_doc_lists_the_served_series():
    assert documented(DOC.read_text(encoding="utf-8")) == served()


def test_twin_a_renamed_retyped_or_missing_series_is_told_apart():
    doc = DOC.read_text(encoding="utf-8")
    for old, new in (
        ("`lightllm_free_kv_tokens` | gauge", "`lightllm_free_kv_token` | gauge"),
        ("`lightllm_preemptions_total` | counter", "`lightllm_preemptions_total` | gauge"),
        ("`lightllm_dp_replica_prefix_cache_hit_tokens_total{replica,tier}`", "`lightllm_dp_replica_x{replica}`"),
    ):
        assert old in doc
        assert documented(doc.replace(old, new)) != served()
    row = next(line for line in doc.splitlines() if line.startswith("| `lightllm_replay_folds_total`"))
    assert documented(doc.replace(row + "\n", "")) != served()
