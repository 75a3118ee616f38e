"""An overlapped step's deferred masks (`grammar_masks.MaskJob`): filled on the mask thread once started, they equal
`mask_windows` over the same matchers; rows of finished requests stay free; a job applied before its masks exist
is refused where no device waits for them; a job whose start fails releases the wait and fails at `wait`; a CPU
never defers. A job started with `before` runs it on the mask thread ahead of the masks (which then see the
matchers it moved); `advance_many` moves many matchers as `RequestGrammar.advance` moves each. The host counter's wait kernel under the Triton interpreter: a counter at its target passes at once,
one below it gives up after its spins."""

from __future__ import annotations

import pytest
import torch

from lightllm.engine.grammar import advance_many, mask_windows
from lightllm.engine.grammar_masks import MaskJob
from lightllm.engine.request import Request, Status
from lightllm.engine.sampling_params import SamplingParams
from unit_tests.engine.test_grammar import VOCAB, grammar_setup
from unit_tests.engine.test_grammar import _request as _fresh_request


@pytest.fixture(scope="module")
def setup():
    return grammar_setup()


def _request(setup, name: str, prefix: list[int] = ()) -> Request:
    req = _fresh_request(*setup)
    req.req_id = name
    assert req.grammar.advance(list(prefix)) is None
    return req


def _prefix(setup) -> list[int]:
    """Tokens of a valid start of the schema's JSON."""
    _, _, hf = setup
    return hf.encode('{"n": 1', add_special_tokens=False)


def _windows(setup):
    free = Request("free", [3], SamplingParams(), frozenset(), 8)
    constrained = [_request(setup, "a"), _request(setup, "b", _prefix(setup)), _request(setup, "c", _prefix(setup)[:2])]
    reqs = [constrained[0], free, constrained[1], constrained[2]]
    return [(req, i, 1, []) for i, req in enumerate(reqs)]


def test_a_started_job_masks_like_mask_windows(setup):
    windows = _windows(setup)
    logits = torch.randn(len(windows), VOCAB)
    expected = mask_windows(windows, logits)
    job = MaskJob.of(windows, *logits.shape, logits.device)
    assert not job.deferred
    job.start()
    job.wait()
    masked = job.apply(logits)
    assert torch.equal(masked, expected)
    # twin: the rows differ from one another, so a job that filled the wrong rows would not match
    assert not torch.equal(torch.isfinite(expected[0]), torch.isfinite(expected[2]))
    assert torch.equal(masked[1], logits[1])


def test_rows_of_finished_requests_stay_free(setup):
    windows = _windows(setup)
    logits = torch.randn(len(windows), VOCAB)
    job = MaskJob.of(windows, *logits.shape, logits.device)
    windows[2][0].status = Status.FINISHED
    job.wait()
    masked = job.apply(logits)
    assert torch.equal(masked[2], logits[2])
    # twin: the unfinished constrained row is masked
    assert not torch.equal(masked[0], logits[0])


def test_applying_before_the_masks_exist_is_refused_without_a_device_wait(setup):
    windows = _windows(setup)
    logits = torch.randn(len(windows), VOCAB)
    job = MaskJob.of(windows, *logits.shape, logits.device)
    with pytest.raises(RuntimeError, match="before they were computed"):
        job.apply(logits)
    job.wait()
    job.apply(logits)


def test_a_job_that_cannot_start_fails_at_wait(setup, monkeypatch):
    windows = _windows(setup)
    logits = torch.randn(len(windows), VOCAB)
    job = MaskJob.of(windows, *logits.shape, logits.device)
    monkeypatch.setattr(type(windows[0][0].grammar), "matcher", property(lambda g: 1 / 0))
    job.start_or_release()
    with pytest.raises(ZeroDivisionError):
        job.wait()


def test_before_moves_the_matchers_on_the_mask_thread_ahead_of_the_masks(setup):
    """The overlapped step's order: the job is started before the step's tokens are advanced, with the advance as
    its `before`; its masks equal `mask_windows` of matchers advanced first."""
    import threading

    _, _, hf = setup
    prefix = _prefix(setup)
    # each constrained row's next token: a fresh row's first, "}" after the whole prefix, the third after two
    tokens = {"a": prefix[0], "b": hf.encode("}", add_special_tokens=False)[0], "c": prefix[2]}
    windows, reference = _windows(setup), _windows(setup)
    for req, *_ in reference:
        assert req.grammar is None or req.grammar.advance([tokens[req.req_id]]) is None
    logits = torch.randn(len(windows), VOCAB)
    expected = mask_windows(reference, logits)
    threads = []

    def before():
        threads.append(threading.current_thread())
        return advance_many([(req.grammar, tokens[req.req_id]) for req, *_ in windows if req.grammar is not None])

    job = MaskJob.of(windows, *logits.shape, logits.device)
    job.start(before=before)
    assert job.runs_before and job.before_result() == [None] * 3
    job.wait()
    assert torch.equal(job.apply(logits), expected) and threads[0] is not threading.current_thread()
    # twin: the masks of matchers that were not advanced differ
    assert not torch.equal(mask_windows(_windows(setup), logits), expected)


def test_a_failing_before_fails_the_job_and_releases_its_wait(setup):
    windows = _windows(setup)
    logits = torch.randn(len(windows), VOCAB)
    job = MaskJob.of(windows, *logits.shape, logits.device)
    job.start(before=lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        job.before_result()
    with pytest.raises(ZeroDivisionError):
        job.wait()
    assert job._done
    # twin: without `before` the job has no outcome of one
    plain = MaskJob.of(windows, *logits.shape, logits.device)
    plain.start()
    plain.wait()
    assert not plain.runs_before


def test_advance_many_moves_each_matcher_as_advance_does(setup):
    _, _, hf = setup
    prefix = _prefix(setup)
    one = [_request(setup, "a"), _request(setup, "b", prefix[:2])]
    each = [_request(setup, "a"), _request(setup, "b", prefix[:2])]
    tokens = [prefix[0], prefix[2]]
    assert advance_many([(r.grammar, t) for r, t in zip(one, tokens)]) == [None, None]
    assert [r.grammar.advance([t]) for r, t in zip(each, tokens)] == [None, None]
    for a, b in zip(one, each):
        assert a.grammar.matcher.compute_bitmask() == b.grammar.matcher.compute_bitmask()
    # a token the grammar refuses: the same message as advance's, the other row unaffected
    bad = hf.encode("}", add_special_tokens=False)[0]
    errors = advance_many([(one[0].grammar, bad), (one[1].grammar, prefix[3])])
    assert errors[0] == each[0].grammar.advance([bad]) and errors[0].startswith(f"token {bad} left the grammar")
    assert errors[1] is None


def test_no_windows_with_a_grammar_need_no_job(setup):
    free = Request("free", [3], SamplingParams(), frozenset(), 8)
    assert MaskJob.of([(free, 0, 1, [])], 1, VOCAB, torch.device("cpu")) is None


def test_a_cpu_never_defers(setup):
    windows = _windows(setup)
    host_masks = windows[0][0].grammar.host_masks
    assert host_masks.device_wait_works(torch.device("cpu")) is False


@pytest.mark.parametrize("start,target,spins", [(5, 5, 1 << 30), (7, 5, 1 << 30), (2, 5, 50)])
def test_the_wait_kernel_passes_a_reached_target_and_gives_up_after_its_spins(start, target, spins):
    from lightllm.kernels.host_flag import wait_host_flag_kernel

    flag = torch.tensor([start], dtype=torch.int64)
    # under the interpreter the kernel runs on the host at launch: returning at all is the check (a counter below
    # the target with unbounded spins would never return)
    wait_host_flag_kernel[(1,)](flag, target, spins)
    assert flag.item() == start


LOWER = """
from lightllm.kernels.host_flag import wait_host_flag_kernel
from unit_tests.helpers.sm90 import lower_sm90

ptx = lower_sm90(wait_host_flag_kernel, {}, 1, types={"flag": "*i64", "target": "i64", "max_spins": "i32"}).asm["ptx"]
print("volatile loads", ptx.count("ld.volatile.global"))
print("branches", ptx.count("bra"))
"""


def test_the_wait_kernel_lowers_to_sm90_with_volatile_reads_in_a_loop():
    import os
    import subprocess
    import sys

    from unit_tests.helpers.sm90 import PTXAS

    if not os.path.exists(PTXAS):
        pytest.skip("Triton's bundled ptxas is not installed")
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    # a subprocess: this session interprets, and the interpreter never lowers a kernel
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, "-c", LOWER], cwd=root, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    counts = dict(line.rsplit(" ", 1) for line in run.stdout.splitlines())
    # the first read and the loop's (a load hoisted out of the loop would spin on a stale value forever)
    assert int(counts["volatile loads"]) >= 2 and int(counts["branches"]) >= 1, run.stdout
