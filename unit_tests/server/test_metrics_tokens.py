"""The per-token series of /metrics (generated tokens, inter-token latency), kept in plain fields by `Metrics`, equal
what prometheus_client's own Counter and Histogram report for the same observations."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from lightllm.engine.messages import EngineStats, Finished, TokenChunk
from lightllm.server.http import metrics as metrics_module
from lightllm.server.http.metrics import LATENCY_BUCKETS, Metrics

SERIES = ("lightllm_generation_tokens", "lightllm_inter_token_latency_seconds")


def _samples(text: bytes) -> dict:
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        if family.name in SERIES:
            for s in family.samples:
                if not s.name.endswith("_created"):
                    out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _run(monkeypatch, perturb: bool = False) -> tuple[dict, dict]:
    """Random streams through `Metrics` at scripted times, and the same observations, derived here from the
    definition, into prometheus_client's own metrics. `perturb` moves one reference observation."""
    rng = random.Random()
    clock = [1000.0]
    monkeypatch.setattr(metrics_module.time, "monotonic", lambda: clock[0])
    metrics = Metrics(EngineStats)
    ref = CollectorRegistry()
    tokens = Counter("lightllm_generation_tokens", "generated tokens", registry=ref)
    itl = Histogram(
        "lightllm_inter_token_latency_seconds",
        "time per generated token after the first",
        buckets=LATENCY_BUCKETS,
        registry=ref,
    )
    observations = []
    last: dict[str, float | None] = {}
    events = []
    for i in range(40):
        req = f"r{i}"
        events.append(("submit", req, None))
        events += [("chunk", req, rng.randint(1, 4)) for _ in range(rng.randint(0, 12))]
        events.append(("finish", req, None))
    # interleave the requests' events, each request's in order
    order = sorted(range(len(events)), key=lambda k: (rng.random(), k))
    pending = {req: [e for e in events if e[1] == req] for req in {e[1] for e in events}}
    for _ in order:
        req = rng.choice(sorted(r for r, left in pending.items() if left))
        kind, req, n = pending[req].pop(0)
        clock[0] += rng.choice([0.0, rng.uniform(0, 0.003), rng.uniform(0, 0.2), rng.uniform(0, 3)])
        if kind == "submit":
            metrics.on_submit(req)
            last[req] = None
        elif kind == "chunk":
            metrics.on_output(TokenChunk(req, list(range(n))))
            tokens.inc(n)
            if last[req] is None:
                observations += [0.0] * (n - 1)
            else:
                observations += [(clock[0] - last[req]) / n] * n
            last[req] = clock[0]
        else:
            metrics.on_output(Finished(req, "length"))
        if not pending[req]:
            del pending[req]
    if perturb:
        observations[rng.randrange(len(observations))] += 0.3
    for value in observations:
        itl.observe(value)
    return _samples(metrics.render()), _samples(generate_latest(ref))


def test_per_token_series_equal_prometheus_clients_own(monkeypatch):
    ours, reference = _run(monkeypatch)
    assert ours.keys() == reference.keys() and len(ours) == len(LATENCY_BUCKETS) + 4
    for key, value in reference.items():
        assert abs(ours[key] - value) <= 1e-9 * max(1.0, abs(value)), key


def test_twin_one_moved_observation_changes_the_series(monkeypatch):
    ours, reference = _run(monkeypatch, perturb=True)
    assert any(abs(ours[key] - value) > 1e-9 for key, value in reference.items())
