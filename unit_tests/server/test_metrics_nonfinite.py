"""/metrics counts the sequences that ended because their logits held NaN or +inf
(`lightllm_nonfinite_logits_requests_total`), and no other error."""

from __future__ import annotations

from lightllm.engine.logits_check import NONFINITE_LOGITS_ERROR
from lightllm.engine.messages import EngineStats, Finished
from lightllm.server.http.metrics import Metrics


def test_the_metric_counts_requests_ended_by_nonfinite_logits():
    metrics = Metrics(EngineStats)
    for req_id, error in (("a", NONFINITE_LOGITS_ERROR), ("b", "the model step failed"), ("c", None)):
        metrics.on_submit(req_id)
        metrics.on_output(Finished(req_id, "error" if error else "stop", error=error))
    assert b"lightllm_nonfinite_logits_requests_total 1.0" in metrics.render()
