"""Prometheus metrics: request/token counters and latency histograms observed in the HTTP process, plus engine
gauges read from the latest `EngineStats` snapshot at scrape time.

What is observed once per streamed token (the generated-token count, inter-token latency) is kept in plain fields
of the event loop's thread and exported at scrape time: prometheus_client's Counter and Histogram take a lock and
check their state on every update, which was a fifth of the front-end's CPU per token."""

from __future__ import annotations

import bisect
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from lightllm.engine.logits_check import NONFINITE_LOGITS_ERROR
from lightllm.engine.messages import EngineOutput, EngineStats, Finished, TokenChunk

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _EngineCollector:
    def __init__(self, get_stats):
        self.get_stats = get_stats

    def collect(self):
        s: EngineStats = self.get_stats()
        gauges = {
            "num_requests_waiting": ("requests queued for admission (queue depth)", s.num_waiting),
            "num_requests_running": ("requests holding a state slot", s.num_running),
            "free_kv_tokens": ("free KV cache tokens", s.num_free_kv_tokens),
            "free_state_slots": ("free linear-attention state slots", s.num_free_state_slots),
            "prefix_cache_checkpoint_bytes": (
                "bytes of the stored prefix-cache state checkpoints",
                s.prefix_cache_checkpoint_bytes,
            ),
            "prefix_cache_tokens": (
                "KV tokens held by the prefix cache (shared or reclaimable)",
                s.prefix_cache_tokens,
            ),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"lightllm_{name}", doc, value=value)
        counters = {
            "preemptions": ("requests preempted and recomputed", s.num_preemptions),
            "engine_steps": ("model steps run", s.num_steps),
            "spec_windows": ("decode windows that carried drafts", s.num_spec_windows),
            "spec_draft_tokens": ("draft tokens proposed", s.num_draft_tokens),
            "spec_accepted_tokens": ("draft tokens accepted", s.num_accepted_draft_tokens),
            "prefix_cache_queried_tokens": (
                "tokens of admitted requests looked up in the prefix cache",
                s.prefix_cache_queried_tokens,
            ),
            "prefix_cache_hit_tokens": (
                "tokens resumed from the prefix cache instead of recomputed",
                s.prefix_cache_hit_tokens,
            ),
            "prefix_cache_host_hit_tokens": (
                "tokens resumed from the host tier (shared host memory) instead of recomputed",
                s.prefix_cache_host_hit_tokens,
            ),
            "prefix_cache_checkpoints_stored": (
                "state checkpoints stored in the prefix cache",
                s.prefix_cache_checkpoints_stored,
            ),
            "prefix_cache_checkpoints_evicted": (
                "state checkpoints evicted from the prefix cache",
                s.prefix_cache_checkpoints_evicted,
            ),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(f"lightllm_{name}", doc, value=value)
        lengths = GaugeMetricFamily(
            "lightllm_spec_acceptance_length_windows",
            "drafted decode windows by tokens produced (accepted drafts + 1); windows without drafts are not counted",
            labels=["length"],
        )
        for i, count in enumerate(s.accepted_length_counts):
            lengths.add_metric([str(i + 1)], count)
        yield lengths
        total = sum(s.accepted_length_counts)
        mean = sum((i + 1) * c for i, c in enumerate(s.accepted_length_counts)) / total if total else 0.0
        yield GaugeMetricFamily(
            "lightllm_spec_mean_acceptance_length", "mean tokens per drafted decode window", value=mean
        )
        pool = GaugeMetricFamily("lightllm_state_pool_bytes", "linear-attention state memory", labels=["mode"])
        for mode, nbytes in s.state_pool_bytes.items():
            pool.add_metric([mode], nbytes)
        yield pool
        if s.num_folds is not None:
            yield CounterMetricFamily("lightllm_replay_folds", "replay history folds", value=s.num_folds)


class LoopHistogram:
    """A histogram updated from one thread only (the event loop's): bucket counts and a sum, no lock."""

    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        # counts[i]: observations in (buckets[i - 1], buckets[i]]; the last one past every bound
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def family(self, name: str, doc: str) -> HistogramMetricFamily:
        cumulative, total = [], 0
        for bound, count in zip([*map(str, self.buckets), "+Inf"], self.counts):
            total += count
            cumulative.append((bound, total))
        return HistogramMetricFamily(name, doc, buckets=cumulative, sum_value=self.sum)


class _TokenCollector:
    """The per-token series, from the plain fields `Metrics` keeps."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def collect(self):
        m = self.metrics
        yield CounterMetricFamily("lightllm_generation_tokens", "generated tokens", value=m.num_generation_tokens)
        yield m.itl.family("lightllm_inter_token_latency_seconds", "time per generated token after the first")


class Metrics:
    def __init__(self, get_stats):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("lightllm_requests", "finished sequences", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("lightllm_prompt_tokens", "prompt tokens of finished sequences", registry=r)
        self.ttft = Histogram(
            "lightllm_time_to_first_token_seconds", "submit to first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.itl = LoopHistogram(LATENCY_BUCKETS)
        self.e2e = Histogram(
            "lightllm_e2e_request_latency_seconds", "submit to finish", buckets=LATENCY_BUCKETS, registry=r
        )
        self.nonfinite = Counter(
            "lightllm_nonfinite_logits_requests",
            "sequences ended with an error because their logits held NaN or +inf",
            registry=r,
        )
        # plain running totals (the periodic throughput log; generated tokens are exported from here)
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        r.register(_EngineCollector(get_stats))
        r.register(_TokenCollector(self))
        # req_id -> (submit time, last token time or None)
        self._times: dict[str, tuple[float, float | None]] = {}

    def on_submit(self, req_id: str) -> None:
        self._times[req_id] = (time.monotonic(), None)

    def on_output(self, out: EngineOutput) -> None:
        times = self._times.get(out.req_id)
        if times is None:
            return
        now = time.monotonic()
        submitted, last = times
        if isinstance(out, TokenChunk) and out.token_ids:
            self.num_generation_tokens += len(out.token_ids)
            if last is None:
                self.ttft.observe(now - submitted)
                for _ in out.token_ids[1:]:
                    self.itl.observe(0.0)
            else:
                # tokens accepted together share the step's latency
                for _ in out.token_ids:
                    self.itl.observe((now - last) / len(out.token_ids))
            self._times[out.req_id] = (submitted, now)
        elif isinstance(out, Finished):
            self.prompt_tokens.inc(out.num_prompt_tokens)
            self.num_prompt_tokens += out.num_prompt_tokens
            self.e2e.observe(now - submitted)
            if out.error == NONFINITE_LOGITS_ERROR:
                self.nonfinite.inc()
            del self._times[out.req_id]

    def in_flight(self) -> dict[str, float]:
        """Submitted, unfinished sequences -> their submit time (monotonic)."""
        return {req_id: submitted for req_id, (submitted, _) in self._times.items()}

    def count_finished(self, reason: str) -> None:
        """Count a finished sequence by the reason its client saw (a stop string is "stop", not "abort")."""
        self.requests.labels(reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
