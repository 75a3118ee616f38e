"""Prometheus metrics: request/token counters and latency histograms observed in the HTTP process, plus engine
gauges read from the latest `EngineStats` snapshot at scrape time.

The front-end's own counters and histograms are columns of its process's row of `MetricRows`, summed over the
processes (`--http_workers`) at scrape time: the row is updated from the event loop's thread with plain stores
(prometheus_client's Counter and Histogram take a lock and check their state on every update, a fifth of the
front-end's CPU per streamed token), and any process answers /metrics for the whole server."""

from __future__ import annotations

import bisect
import time

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from lightllm.engine.logits_check import NONFINITE_LOGITS_ERROR
from lightllm.engine.messages import EngineOutput, EngineStats, Finished, TokenChunk
from lightllm.server.http.metric_rows import MetricRows

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
            "prefix_cache_host_entries_written": (
                "prefix states copied into the host tier",
                s.prefix_cache_host_entries_written,
            ),
            "prefix_cache_host_entries_skipped": (
                "prefix states not copied into the host tier because its copies were behind the evictions",
                s.prefix_cache_host_entries_skipped,
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


# the finish reasons a client sees (engine `Finished.reason`, a stop string's "stop"), each a column of the rows
FINISH_REASONS = ("stop", "length", "abort", "error")


class _Layout:
    """Columns of a front-end process's row (`MetricRows`): counters, a gauge, and three histograms as bucket
    counts (the last one past every bound) followed by their sum."""

    PROMPT, GENERATION, NONFINITE, IN_FLIGHT = range(4)
    REQUESTS = 4
    HISTOGRAMS = REQUESTS + len(FINISH_REASONS)
    HIST_WIDTH = len(LATENCY_BUCKETS) + 2
    TTFT = HISTOGRAMS
    ITL = TTFT + HIST_WIDTH
    E2E = ITL + HIST_WIDTH
    WIDTH = E2E + HIST_WIDTH


def _observe(row, column: int, value: float) -> None:
    row[column + bisect.bisect_left(LATENCY_BUCKETS, value)] += 1
    row[column + len(LATENCY_BUCKETS) + 1] += value


def _histogram(rows: MetricRows, column: int, name: str, doc: str) -> HistogramMetricFamily:
    values = rows.total(column, column + _Layout.HIST_WIDTH)
    cumulative, total = [], 0.0
    for bound, count in zip([*map(str, LATENCY_BUCKETS), "+Inf"], values[:-1]):
        total += count
        cumulative.append((bound, total))
    return HistogramMetricFamily(name, doc, buckets=cumulative, sum_value=float(values[-1]))


class _FrontendCollector:
    """The front-end's series, summed over its processes' rows."""

    def __init__(self, rows: MetricRows):
        self.rows = rows

    def collect(self):
        rows, L = self.rows, _Layout
        requests = CounterMetricFamily("lightllm_requests", "finished sequences", labels=["finish_reason"])
        for i, reason in enumerate(FINISH_REASONS):
            requests.add_metric([reason], float(rows.total(L.REQUESTS + i)[0]))
        yield requests
        for column, name, doc in (
            (L.PROMPT, "lightllm_prompt_tokens", "prompt tokens of finished sequences"),
            (L.GENERATION, "lightllm_generation_tokens", "generated tokens"),
            (
                L.NONFINITE,
                "lightllm_nonfinite_logits_requests",
                "sequences ended with an error because their logits held NaN or +inf",
            ),
        ):
            yield CounterMetricFamily(name, doc, value=float(rows.total(column)[0]))
        for column, name, doc in (
            (L.TTFT, "lightllm_time_to_first_token_seconds", "submit to first token"),
            (L.ITL, "lightllm_inter_token_latency_seconds", "time per generated token after the first"),
            (L.E2E, "lightllm_e2e_request_latency_seconds", "submit to finish"),
        ):
            yield _histogram(rows, column, name, doc)
        if rows.rows > 1:
            # how the kernel spread the load over the HTTP processes (--http_workers)
            finished = CounterMetricFamily(
                "lightllm_http_worker_requests", "finished sequences per HTTP front-end process", labels=["worker"]
            )
            in_flight = GaugeMetricFamily(
                "lightllm_http_worker_sequences_in_flight",
                "submitted, unfinished sequences per HTTP front-end process",
                labels=["worker"],
            )
            for i in range(rows.rows):
                done = sum(rows.value(i, L.REQUESTS + j) for j in range(len(FINISH_REASONS)))
                finished.add_metric([str(i)], done)
                in_flight.add_metric([str(i)], rows.value(i, L.IN_FLIGHT))
            yield finished
            yield in_flight


class Metrics:
    """Request and token counters and latency histograms of one front-end process, in its row of `rows` (a
    private row by default), plus the engine's gauges. Updated from the event loop's thread only."""

    # columns of a row (`MetricRows(Metrics.WIDTH, ...)`)
    WIDTH = _Layout.WIDTH

    def __init__(self, get_stats, rows: MetricRows | None = None):
        self.rows = rows if rows is not None else MetricRows(self.WIDTH)
        assert self.rows.width == self.WIDTH
        self._row = self.rows.own
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(get_stats))
        self.registry.register(_FrontendCollector(self.rows))
        # req_id -> (submit time, last token time or None)
        self._times: dict[str, tuple[float, float | None]] = {}

    @property
    def num_prompt_tokens(self) -> float:
        """Prompt tokens of finished sequences, over every front-end process."""
        return float(self.rows.total(_Layout.PROMPT)[0])

    @property
    def num_generation_tokens(self) -> float:
        """Generated tokens, over every front-end process."""
        return float(self.rows.total(_Layout.GENERATION)[0])

    def in_flight_elsewhere(self) -> int:
        """Submitted, unfinished sequences of the other front-end processes (their last update)."""
        return int(self.rows.others(_Layout.IN_FLIGHT))

    def on_submit(self, req_id: str) -> None:
        self._times[req_id] = (time.monotonic(), None)
        self._row[_Layout.IN_FLIGHT] = len(self._times)

    def on_output(self, out: EngineOutput) -> None:
        times = self._times.get(out.req_id)
        if times is None:
            return
        now = time.monotonic()
        submitted, last = times
        row = self._row
        if isinstance(out, TokenChunk) and out.token_ids:
            n = len(out.token_ids)
            row[_Layout.GENERATION] += n
            if last is None:
                _observe(row, _Layout.TTFT, now - submitted)
                for _ in range(n - 1):
                    _observe(row, _Layout.ITL, 0.0)
            else:
                # tokens accepted together share the step's latency
                for _ in range(n):
                    _observe(row, _Layout.ITL, (now - last) / n)
            self._times[out.req_id] = (submitted, now)
        elif isinstance(out, Finished):
            row[_Layout.PROMPT] += out.num_prompt_tokens
            _observe(row, _Layout.E2E, now - submitted)
            if out.error == NONFINITE_LOGITS_ERROR:
                row[_Layout.NONFINITE] += 1
            del self._times[out.req_id]
            row[_Layout.IN_FLIGHT] = len(self._times)

    def in_flight(self) -> dict[str, float]:
        """Submitted, unfinished sequences of this process -> their submit time (monotonic)."""
        return {req_id: submitted for req_id, (submitted, _) in self._times.items()}

    def count_finished(self, reason: str) -> None:
        """Count a finished sequence by the reason its client saw (a stop string is "stop", not "abort")."""
        self._row[_Layout.REQUESTS + FINISH_REASONS.index(reason)] += 1

    def render(self) -> bytes:
        return generate_latest(self.registry)
