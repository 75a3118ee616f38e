"""Scheduler and engine with a prefix cache, against the fake runner, with exact batches: chunks cut at interval
boundaries, branch points and hinted positions; resumed requests start past their hit; what is published when
(prefill checkpoints, finish, abort, preemption) and never after a failed step."""

from __future__ import annotations

from lightllm.cache.prefix import PrefixMatch
from lightllm.engine.engine import Engine
from lightllm.engine.messages import NewRequest
from lightllm.engine.sampling_params import SamplingParams
from unit_tests.engine.fake_runner import FakeRunner

GREEDY = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


class CachingFakeRunner(FakeRunner):
    """The fake runner with a scripted prefix cache: `hits[tuple(prompt)] = (resumed, matched)` tokens, and a
    record of every publish as (handle, number of tokens)."""

    def __init__(self, *args, hits: dict | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.hits = hits or {}
        self.published: list[tuple[int, int]] = []

    def match_prefix(self, token_ids, namespace=b""):
        resumed, matched = self.hits.get(tuple(token_ids[: self._key_len(token_ids)]), (0, 0))
        return PrefixMatch(resumed, 0, matched)

    def add_request(self, prefix=None, namespace=b""):
        handle = super().add_request(prefix)
        if prefix:
            # a hit resumes the cached tokens: the fake's "KV" is the history itself
            self.cache[handle] = list(prefix[: self.match_prefix(prefix).num_tokens])
        return handle

    def publish(self, handle, token_ids):
        super().publish(handle, token_ids)
        self.published.append((handle, len(token_ids)))

    def _key_len(self, token_ids) -> int:
        return max((len(k) for k in self.hits if tuple(token_ids[: len(k)]) == k), default=0)


def _engine(runner, interval: int, chunk: int = 64, max_len: int = 64, short_resume: int = 0) -> Engine:
    return Engine(
        runner,
        max_running_requests=4,
        chunked_prefill_size=chunk,
        max_req_total_len=max_len,
        prefix_cache_checkpoint_interval=interval,
        short_resume_tokens=short_resume,
    )


def _drain(engine, msgs) -> dict[str, list[int]]:
    tokens = {m.req_id: [] for m in msgs}
    for m in msgs:
        assert engine.add_request(m) == []
    while engine.has_work():
        for out in engine.step():
            tokens[out.req_id] += getattr(out, "token_ids", [])
    return tokens


def _batches(runner) -> list[tuple]:
    return [(b.query_lens, b.num_cached_tokens, b.num_prefill_rows) for b in runner.batches]


def test_chunks_end_at_the_last_interval_boundary_they_cross():
    runner = CachingFakeRunner(kv_tokens=200)
    _drain(_engine(runner, interval=8, chunk=20), [NewRequest("a", list(range(1, 31)), GREEDY)])
    # 0 -> 20 crosses 8 and 16: cut at 16; 16 -> 29 ends the prefill (one short of the prompt): not cut; the last
    # prompt token is a decode window
    assert _batches(runner)[:4] == [([16], [0], 1), ([13], [16], 1), ([1], [29], 0), ([1], [30], 0)]
    # checkpoints at 16 (interval) and 29 (prefill end), then the finished request's committed 31 tokens
    assert runner.published == [(0, 16), (0, 29), (0, 31)]


def test_branch_point_and_hint_each_end_a_chunk():
    prompt = list(range(1, 21))
    runner = CachingFakeRunner(kv_tokens=200, hits={tuple(prompt[:5]): (0, 5)})
    msg = NewRequest("a", prompt, GREEDY, checkpoint_hints=[12, 0, 40])
    tokens = _drain(_engine(runner, interval=1000), [msg])
    assert _batches(runner)[:4] == [([5], [0], 1), ([7], [5], 1), ([7], [12], 1), ([1], [19], 0)]
    assert runner.published == [(0, 5), (0, 12), (0, 19), (0, 21)]
    assert tokens["a"] == FakeRunner().greedy(prompt, 2)


def test_without_a_prefix_cache_nothing_cuts_chunks():
    prompt = list(range(1, 21))
    runner = CachingFakeRunner(kv_tokens=200, hits={tuple(prompt[:5]): (0, 5)})
    _drain(_engine(runner, interval=0), [NewRequest("a", prompt, GREEDY, checkpoint_hints=[12])])
    assert _batches(runner)[0] == ([20], [0], 1)


def test_a_hit_starts_past_the_resumed_tokens_and_reports_them():
    prompt = list(range(1, 25))
    runner = CachingFakeRunner(kv_tokens=200, hits={tuple(prompt[:16]): (16, 20)})
    engine = _engine(runner, interval=8)
    engine.add_request(NewRequest("a", prompt, GREEDY))
    first = engine.step()
    # resumed 16, branch point 20 cuts the chunk, the prefill end 23 follows, then the last prompt token's window
    assert _batches(runner) == [([4], [16], 1)]
    assert first == [] and engine.step() == []
    assert _batches(runner)[-1] == ([3], [20], 1)
    out = engine.step()
    assert out[0].num_cached_tokens == 16 and _batches(runner)[-1] == ([1], [23], 0)
    assert runner.published == [(0, 20), (0, 23)]


def test_publish_on_finish_abort_and_preemption_never_after_failure():
    runner = CachingFakeRunner(max_requests=2, kv_tokens=12)
    engine = _engine(runner, interval=1000, chunk=16, max_len=12)
    # A and B fill the KV; B (admitted last) is preempted and publishes its committed tokens
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    _drain(engine, [NewRequest("A", [1, 2, 3, 4], params), NewRequest("B", [4, 3, 2, 1], params)])
    assert engine.scheduler.num_preemptions == 1
    # prefill ends one short of the prompts (A, B), B preempted at 6, A finished at 9, B's re-prefill of its 7
    # tokens but the last (fed by its decode window), B finished at 9
    assert runner.published == [(0, 3), (1, 3), (1, 6), (0, 9), (0, 6), (0, 9)]
    # an abort publishes what is committed
    runner.published.clear()
    engine.add_request(NewRequest("C", [5, 6, 7], params))
    engine.step()
    assert runner.published == []  # the prefill end's publish waits for the next step
    engine.abort("C")
    assert runner.published == [(0, 2)]
    engine.step()  # the queued publish of the aborted request is dropped
    assert runner.published == [(0, 2)] and not engine.has_work()
    # a failed step publishes nothing
    failing = CachingFakeRunner(kv_tokens=100, fail_token=9)
    _drain(_engine(failing, interval=4), [NewRequest("D", [1, 2, 3, 4, 5, 9, 7], GREEDY)])
    assert failing.published == []


def test_an_exact_repeat_resumes_before_its_last_token_and_prefills_nothing():
    """A hit at all but the last token: the admission step is that token's decode window (no prefill row), its
    logits give the first token, and the text equals the reference."""
    prompt = list(range(3, 17))
    runner = CachingFakeRunner(kv_tokens=200, hits={tuple(prompt[:13]): (13, 13)})
    engine = _engine(runner, interval=8)
    engine.add_request(NewRequest("a", prompt, GREEDY))
    out = engine.step()
    assert _batches(runner) == [([1], [13], 0)]
    assert out[0].num_cached_tokens == 13 and out[0].token_ids == FakeRunner().greedy(prompt, 1)
    while engine.has_work():
        out += engine.step()
    assert [t for o in out for t in getattr(o, "token_ids", [])] == FakeRunner().greedy(prompt, 2)
    # nothing prefilled, nothing new to checkpoint but the finished request's end
    assert runner.published == [(0, 15)]


def test_a_one_token_prompt_samples_from_its_prefill():
    runner = CachingFakeRunner(kv_tokens=200)
    tokens = _drain(_engine(runner, interval=8), [NewRequest("a", [7], GREEDY)])
    assert _batches(runner) == [([1], [0], 1), ([1], [1], 0)]
    assert tokens["a"] == FakeRunner().greedy([7], 2)


def test_a_hit_with_a_short_suffix_feeds_its_last_token_in_the_prefill():
    """Resumed with at most `short_resume_tokens` left: the chunk after the branch point runs to the end of the
    prompt and its logits give the first token (one step sooner than a decode window of the last token); no
    checkpoint at the prompt end is after its last token. The twin with a smaller bound keeps the decode window."""
    prompt = list(range(1, 26))
    for bound, expected, published in (
        (9, [([4], [16], 1), ([5], [20], 1), ([1], [25], 0)], [(0, 20), (0, 25), (0, 26)]),
        (8, [([4], [16], 1), ([4], [20], 1), ([1], [24], 0), ([1], [25], 0)], [(0, 20), (0, 24), (0, 26)]),
    ):
        runner = CachingFakeRunner(kv_tokens=200, hits={tuple(prompt[:16]): (16, 20)})
        engine = _engine(runner, interval=8, short_resume=bound)
        engine.add_request(NewRequest("a", prompt, GREEDY))
        steps = [engine.step() for _ in range(len(expected) - 1)]
        first_at = next(i for i, out in enumerate(steps) if any(getattr(o, "token_ids", None) for o in out))
        assert first_at == (1 if bound == 9 else 2)
        while engine.has_work():
            steps.append(engine.step())
        assert _batches(runner) == expected
        assert runner.published == published
        tokens = [t for out in steps for o in out for t in getattr(o, "token_ids", [])]
        assert tokens == FakeRunner().greedy(prompt, 2)


def test_a_steps_publishes_and_releases_come_after_its_outputs():
    """The step that emits tokens returns before the runner publishes anything of it (the checkpoint export would
    delay the tokens); the next step publishes first, then a finished request's slot is free again."""
    prompt = list(range(1, 31))
    runner = CachingFakeRunner(max_requests=2, kv_tokens=200)
    engine = _engine(runner, interval=8, chunk=20)
    engine.add_request(NewRequest("a", prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)))
    assert engine.step() == [] and runner.published == []  # prefill 0 -> 16
    assert engine.step() == [] and runner.published == [(0, 16)]  # 16 -> 29
    out = engine.step()  # the last prompt token's window: the one token, and the finish
    assert [o.token_ids for o in out if hasattr(o, "token_ids")] == [FakeRunner().greedy(prompt, 1)]
    assert out[-1].reason == "length"
    assert runner.published == [(0, 16), (0, 29)] and runner.num_free_requests() == 1
    assert engine.has_work()
    assert engine.step() == []
    assert runner.published == [(0, 16), (0, 29), (0, 30)] and runner.num_free_requests() == 2
    assert not engine.has_work()


class FailingPublishRunner(CachingFakeRunner):
    def publish(self, handle, token_ids):
        if len(token_ids) == self.failing_length:
            raise RuntimeError("export failed")
        super().publish(handle, token_ids)


def test_a_failed_publish_loses_the_cache_entry_only():
    """A publish that raises after the step: the request's tokens were out and it finished as it would have, its
    slot is freed all the same, and a request running beside it finishes unharmed with the reference text."""
    runner = FailingPublishRunner(max_requests=2, kv_tokens=200)
    runner.failing_length = 5  # "a"'s finish: its prompt (its one token was never fed)
    engine = _engine(runner, interval=1000)
    short = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    tokens = _drain(engine, [NewRequest("a", [9, 8, 7, 6, 5], short), NewRequest("b", list(range(1, 9)), GREEDY)])
    assert tokens == {"a": FakeRunner().greedy([9, 8, 7, 6, 5], 1), "b": FakeRunner().greedy(list(range(1, 9)), 2)}
    assert (0, 5) not in runner.published and (1, 9) in runner.published
    assert runner.num_free_requests() == 2 and runner.cache == {}
    # the twin: the same run without the failure publishes "a"'s finish
    healthy = FailingPublishRunner(max_requests=2, kv_tokens=200)
    healthy.failing_length = -1
    _drain(_engine(healthy, interval=1000), [NewRequest("a", [9, 8, 7, 6, 5], short)])
    assert (0, 5) in healthy.published
