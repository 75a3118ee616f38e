"""Per-replica views (`replica_rows`, `ReplicaCollector`) of scripted replica states: exact rows and Prometheus
samples, a dead replica's gauges at zero, and a second cache tier added through `HIT_TOKENS_BY_TIER`."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest

from lightllm.engine.messages import EngineStats
from lightllm.server.dp import replica_metrics
from lightllm.server.dp.replica_metrics import ReplicaCollector, replica_rows


def _client():
    stats = [
        EngineStats(
            num_waiting=3,
            num_running=2,
            prefix_cache_queried_tokens=200,
            prefix_cache_hit_tokens=50,
            prefix_cache_host_hit_tokens=20,
        ),
        EngineStats(num_waiting=1, num_running=4, prefix_cache_queried_tokens=0, prefix_cache_hit_tokens=0),
    ]
    engines = [SimpleNamespace(stats=s, num_in_flight=n) for s, n in zip(stats, (5, 4))]
    handles = [SimpleNamespace(process=SimpleNamespace(pid=pid)) for pid in (101, 102)]
    restarter = SimpleNamespace(restarting={1}, num_restarts=[0, 2])
    return SimpleNamespace(
        clients=engines,
        alive=[True, False],
        num_routed=[7, 9],
        replicas=SimpleNamespace(handles=handles, restarter=restarter),
    )


def test_rows_say_what_each_replica_does():
    rows = replica_rows(_client())
    assert rows[0] == {
        "replica": 0,
        "alive": True,
        "restarting": False,
        "pid": 101,
        "num_restarts": 0,
        "num_routed": 7,
        "num_in_flight": 5,
        "num_waiting": 3,
        "num_running": 2,
        "prefix_cache_queried_tokens": 200,
        "prefix_cache_hit_tokens": {"device": 50, "host": 20},
        "prefix_cache_hit_rate": {"device": 0.25, "host": 0.1},
    }
    # a dead replica runs and queues nothing, whatever its engine said last
    assert (rows[1]["alive"], rows[1]["restarting"], rows[1]["num_waiting"], rows[1]["num_running"]) == (
        False,
        True,
        0,
        0,
    )
    assert rows[1]["prefix_cache_hit_rate"] == {"device": 0.0, "host": 0.0}


def _samples(client) -> dict[str, float]:
    registry = CollectorRegistry()
    registry.register(ReplicaCollector(lambda: client))
    lines = generate_latest(registry).decode().splitlines()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines if not line.startswith("#")}


def test_prometheus_samples_carry_the_replica_label():
    samples = _samples(_client())
    assert samples['lightllm_dp_replica_up{replica="0"}'] == 1.0
    assert samples['lightllm_dp_replica_up{replica="1"}'] == 0.0
    assert samples['lightllm_dp_replica_requests_waiting{replica="0"}'] == 3.0
    assert samples['lightllm_dp_replica_requests_running{replica="1"}'] == 0.0
    assert samples['lightllm_dp_replica_requests_in_flight{replica="1"}'] == 4.0
    assert samples['lightllm_dp_replica_restarts_total{replica="1"}'] == 2.0
    assert samples['lightllm_dp_replica_routed_requests_total{replica="0"}'] == 7.0
    assert samples['lightllm_dp_replica_prefix_cache_queried_tokens_total{replica="0"}'] == 200.0
    assert samples['lightllm_dp_replica_prefix_cache_hit_tokens_total{replica="0",tier="device"}'] == 50.0
    assert samples['lightllm_dp_replica_prefix_cache_hit_tokens_total{replica="0",tier="host"}'] == 20.0


def test_no_client_yet_gives_empty_families():
    assert _samples(None) == {}


def test_a_new_tier_shows_up_in_both_views(monkeypatch):
    """The hook for another tier: its EngineStats field, named once, feeds the JSON and the Prometheus views."""
    monkeypatch.setitem(replica_metrics.HIT_TOKENS_BY_TIER, "remote", "prefix_cache_checkpoints_stored")
    client = _client()
    client.clients[0].stats.prefix_cache_checkpoints_stored = 30
    rows = replica_rows(client)
    assert rows[0]["prefix_cache_hit_tokens"] == {"device": 50, "host": 20, "remote": 30}
    assert rows[0]["prefix_cache_hit_rate"] == {"device": 0.25, "host": 0.1, "remote": 0.15}
    assert _samples(client)['lightllm_dp_replica_prefix_cache_hit_tokens_total{replica="0",tier="remote"}'] == 30.0
