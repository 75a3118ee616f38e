"""What the fused kernels' model-parity tests share: a layer's call routed through a kernel and counted, prefill
then decode logits against the transformers oracle, and a twin's distance from it."""

from __future__ import annotations

from collections import Counter

from unit_tests.models.drive import decode, make_runner, prefill
from unit_tests.models.test_parity import assert_logits, max_rel, prompt


def route_through(monkeypatch, calls: Counter, module, name: str, kernel) -> None:
    """`module.name` replaced by `kernel`, each call counted in `calls[name]`."""

    def counted(*args, **kwargs):
        calls[name] += 1
        return kernel(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)


def assert_prefill_and_decode_match(case: str, model_dir, oracle, ids: list[int]) -> None:
    """`ids[:-1]` prefilled, then `ids[-1]` decoded: both steps' last logits equal the oracle's."""
    runner = make_runner(model_dir)
    handle = runner.add_request()
    logits = prefill(runner, handle, ids[:-1])
    step = decode(runner, handle, ids[-1])
    assert_logits(f"{case} prefill", logits, oracle.prefill_logits(ids[:-1])[0, -1])
    assert_logits(f"{case} decode", step, oracle.prefill_logits(ids)[0, -1])


def prefill_mismatch(model_dir, oracle, seed: int, length: int) -> float:
    """Relative distance of a prefill's last logits from the oracle's (a twin's breakage)."""
    ids = prompt(seed, length)
    runner = make_runner(model_dir)
    logits = prefill(runner, runner.add_request(), ids)
    return max_rel(logits, oracle.prefill_logits(ids)[0, -1])
