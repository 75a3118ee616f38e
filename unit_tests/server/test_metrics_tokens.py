"""The front-end's series of /metrics, kept by `Metrics` in its process's row of `MetricRows`, equal what
prometheus_client's own Counter and Histogram report for the same observations; with several front-end processes
(`--http_workers`) any process reports the sum of all."""

from __future__ import annotations

import os
import random

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from lightllm.engine.messages import EngineStats, Finished, TokenChunk
from lightllm.server.http import metrics as metrics_module
from lightllm.server.http.metric_rows import MetricRows
from lightllm.server.http.metrics import LATENCY_BUCKETS, Metrics

SERIES = (
    "lightllm_generation_tokens",
    "lightllm_prompt_tokens",
    "lightllm_requests",
    "lightllm_time_to_first_token_seconds",
    "lightllm_inter_token_latency_seconds",
    "lightllm_e2e_request_latency_seconds",
)


def _samples(text: bytes) -> dict:
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        if family.name in SERIES:
            for s in family.samples:
                if not s.name.endswith("_created"):
                    out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _reference() -> tuple[CollectorRegistry, dict]:
    ref = CollectorRegistry()
    series = {
        "tokens": Counter("lightllm_generation_tokens", "generated tokens", registry=ref),
        "prompt": Counter("lightllm_prompt_tokens", "prompt tokens of finished sequences", registry=ref),
        "requests": Counter("lightllm_requests", "finished sequences", ["finish_reason"], registry=ref),
    }
    for key, name in (
        ("ttft", "lightllm_time_to_first_token_seconds"),
        ("itl", "lightllm_inter_token_latency_seconds"),
        ("e2e", "lightllm_e2e_request_latency_seconds"),
    ):
        series[key] = Histogram(name, "", buckets=LATENCY_BUCKETS, registry=ref)
    for reason in ("stop", "length", "abort", "error"):
        series["requests"].labels(reason)
    return ref, series


def _feed(metrics: Metrics, ref: dict, clock: list, rng, prefix: str) -> list[float]:
    """Random interleaved streams through `metrics` at scripted times, and the same observations, derived here from
    the definition, into the reference metrics; returns the inter-token observations (fed by the caller)."""
    observations = []
    last: dict[str, float | None] = {}
    submitted: dict[str, float] = {}
    events = []
    for i in range(40):
        req = f"{prefix}{i}"
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
            last[req], submitted[req] = None, clock[0]
        elif kind == "chunk":
            metrics.on_output(TokenChunk(req, list(range(n))))
            ref["tokens"].inc(n)
            if last[req] is None:
                ref["ttft"].observe(clock[0] - submitted[req])
                observations += [0.0] * (n - 1)
            else:
                observations += [(clock[0] - last[req]) / n] * n
            last[req] = clock[0]
        else:
            prompt, reason = rng.randint(1, 900), rng.choice(["stop", "length", "abort", "error"])
            metrics.on_output(Finished(req, reason, num_prompt_tokens=prompt))
            metrics.count_finished(reason)
            ref["prompt"].inc(prompt)
            ref["requests"].labels(reason).inc()
            ref["e2e"].observe(clock[0] - submitted[req])
        if not pending[req]:
            del pending[req]
    return observations


def _run(monkeypatch, perturb: bool = False, processes: int = 1) -> tuple[list[dict], dict]:
    """`Metrics` of `processes` front-end processes (rows of one file when several) fed random streams, and the
    reference fed all of them; each process's scrape, and the reference's. `perturb` moves one observation."""
    rng = random.Random()
    clock = [1000.0]
    monkeypatch.setattr(metrics_module.time, "monotonic", lambda: clock[0])
    path = MetricRows.create_file(Metrics.WIDTH, processes) if processes > 1 else None
    try:
        all_metrics = [Metrics(EngineStats, MetricRows(Metrics.WIDTH, processes, i, path)) for i in range(processes)]
        registry, ref = _reference()
        observations = []
        for i, metrics in enumerate(all_metrics):
            observations += _feed(metrics, ref, clock, rng, f"p{i}-r")
        if perturb:
            observations[rng.randrange(len(observations))] += 0.3
        for value in observations:
            ref["itl"].observe(value)
        return [_samples(m.render()) for m in all_metrics], _samples(generate_latest(registry))
    finally:
        if path is not None:
            os.remove(path)


def _equal(ours: dict, reference: dict) -> bool:
    assert ours.keys() == reference.keys() and len(ours) == 3 * (len(LATENCY_BUCKETS) + 3) + 2 + 4
    return all(abs(ours[key] - value) <= 1e-9 * max(1.0, abs(value)) for key, value in reference.items())


def test_series_equal_prometheus_clients_own(monkeypatch):
    (ours,), reference = _run(monkeypatch)
    assert _equal(ours, reference)


def test_every_process_reports_the_sum_of_all(monkeypatch):
    scrapes, reference = _run(monkeypatch, processes=3)
    assert all(_equal(ours, reference) for ours in scrapes)


def test_twin_one_moved_observation_changes_the_series(monkeypatch):
    scrapes, reference = _run(monkeypatch, perturb=True, processes=2)
    assert not any(_equal(ours, reference) for ours in scrapes)


def test_in_flight_of_the_other_processes():
    path = MetricRows.create_file(Metrics.WIDTH, 2)
    try:
        first, second = (Metrics(EngineStats, MetricRows(Metrics.WIDTH, 2, i, path)) for i in range(2))
        for i in range(3):
            first.on_submit(f"a{i}")
        for i in range(2):
            second.on_submit(f"b{i}")
        assert (first.in_flight_elsewhere(), second.in_flight_elsewhere()) == (2, 3)
        second.on_output(Finished("b0", "stop"))
        assert (first.in_flight_elsewhere(), second.in_flight_elsewhere()) == (1, 3)
    finally:
        os.remove(path)


def test_twin_private_rows_see_no_other_process():
    first, second = Metrics(EngineStats), Metrics(EngineStats)
    first.on_submit("a")
    second.on_submit("b")
    assert (first.in_flight_elsewhere(), second.in_flight_elsewhere()) == (0, 0)
