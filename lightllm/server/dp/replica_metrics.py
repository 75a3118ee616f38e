"""What each data-parallel replica is doing, for `GET /dp/replicas` (JSON) and `/metrics` (label `replica`).

Per replica: alive and restarting, its engine's process id, restarts so far, requests routed to it, sequences in
flight (the front-end's view), the engine's queue (waiting) and running sequences, and prefix-cache lookups with
the tokens resumed per tier of the cache. A tier is a field of the engine's `EngineStats` counting only the tokens resumed from that
tier; `HIT_TOKENS_BY_TIER` lists them (a new tier adds its field here and shows up in both views).
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from lightllm.engine.messages import EngineStats

# cache tier -> the EngineStats field counting prompt tokens resumed from it
HIT_TOKENS_BY_TIER = {"device": "prefix_cache_hit_tokens", "host": "prefix_cache_host_hit_tokens"}


def hit_tokens_by_tier(stats: EngineStats) -> dict[str, int]:
    return {tier: getattr(stats, field) for tier, field in HIT_TOKENS_BY_TIER.items()}


def replica_rows(client) -> list[dict]:
    """One dict per replica of a `ReplicaClient`. A dead replica runs and queues nothing; its counters are the
    last its engine reported (a restarted replica counts from zero again)."""
    restarter = client.replicas.restarter
    rows = []
    for i, (engine, up) in enumerate(zip(client.clients, client.alive)):
        stats = engine.stats
        queried = stats.prefix_cache_queried_tokens
        hits = hit_tokens_by_tier(stats)
        rows.append(
            {
                "replica": i,
                "alive": up,
                "restarting": i in restarter.restarting,
                "pid": client.replicas.handles[i].process.pid,
                "num_restarts": restarter.num_restarts[i],
                "num_routed": client.num_routed[i],
                "num_in_flight": engine.num_in_flight,
                "num_waiting": stats.num_waiting if up else 0,
                "num_running": stats.num_running if up else 0,
                "prefix_cache_queried_tokens": queried,
                "prefix_cache_hit_tokens": hits,
                "prefix_cache_hit_rate": {tier: n / queried if queried else 0.0 for tier, n in hits.items()},
            }
        )
    return rows


class ReplicaCollector:
    """Prometheus families with a `replica` label (and `tier` for prefix hits), read at scrape time.
    `get_client()` is the server's `ReplicaClient`, or None before the app started."""

    def __init__(self, get_client):
        self.get_client = get_client

    def collect(self):
        client = self.get_client()
        rows = replica_rows(client) if client is not None else []
        gauges = {
            "up": ("1 while the replica serves, 0 while it is down or restarting", "alive"),
            "requests_in_flight": ("sequences the front-end sent to the replica, unfinished", "num_in_flight"),
            "requests_waiting": ("sequences queued in the replica's engine for admission", "num_waiting"),
            "requests_running": ("sequences holding a state slot on the replica", "num_running"),
        }
        for name, (doc, key) in gauges.items():
            family = GaugeMetricFamily(f"lightllm_dp_replica_{name}", doc, labels=["replica"])
            for row in rows:
                family.add_metric([str(row["replica"])], float(row[key]))
            yield family
        counters = {
            "restarts": ("times the replica's engine was restarted after its process died", "num_restarts"),
            "routed_requests": ("sequences the balancer sent to the replica", "num_routed"),
            "prefix_cache_queried_tokens": (
                "prompt tokens looked up in the replica's prefix cache",
                "prefix_cache_queried_tokens",
            ),
        }
        for name, (doc, key) in counters.items():
            family = CounterMetricFamily(f"lightllm_dp_replica_{name}", doc, labels=["replica"])
            for row in rows:
                family.add_metric([str(row["replica"])], row[key])
            yield family
        hits = CounterMetricFamily(
            "lightllm_dp_replica_prefix_cache_hit_tokens",
            "prompt tokens the replica resumed from its prefix cache, by cache tier",
            labels=["replica", "tier"],
        )
        for row in rows:
            for tier, n in row["prefix_cache_hit_tokens"].items():
                hits.add_metric([str(row["replica"]), tier], n)
        yield hits
