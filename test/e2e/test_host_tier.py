"""The host tier with the real ModelRunner on a tiny checkpoint, engines in one process sharing one arena: a
request resumes from an entry another engine wrote (of another state mode, with and without MTP) with the cold
run's tokens and logprobs within 1e-5; a zeroed entry changes the output; a single engine's device evictions spill
to the host tier and come back on a hit."""

from __future__ import annotations

import random
import threading
import time
import uuid

import numpy as np
import pytest

from lightllm.cache.host_tier import HostArena
from lightllm.cache.host_tier.arena import READY
from lightllm.cache.host_tier.tier import head_bytes
from lightllm.worker.transfer import section_writer
from lightllm.worker.transfer.section_writer import SectionWriter
from unit_tests.helpers.prefix_scenario import Result, drain, fresh, make_engine, submit

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_TOKENS = 6
# (writer mode, reader mode, speculation): the reader resumes what a writer of another mode exported
PAIRS = [
    ("replay", "native", {}),
    ("native", "replay", {"mtp_step": 2}),
    ("compact", "native", {"mtp_step": 2}),
    ("native", "compact", {"spec_ngram": 3}),
]


def _arena(write_through: bool) -> HostArena:
    name = f"lightllm-test-{uuid.uuid4().hex}"
    return HostArena.create(name, 64 << 20, block_bytes=1 << 16, max_entries=64, write_through=write_through)


@pytest.fixture
def arena():
    """Shared by replicas: every new checkpoint is copied at once."""
    a = _arena(write_through=True)
    yield a
    a.unlink()


@pytest.fixture
def single_arena():
    """A single replica's: only what the device drops is copied."""
    a = _arena(write_through=False)
    yield a
    a.unlink()


def _run(engine, req_id: str, prompt: list[int], cache_salt: str | None = None) -> Result:
    res = {req_id: Result()}
    submit(engine, req_id, prompt, MAX_TOKENS, cache_salt)
    drain(engine, res)
    return res[req_id]


def _conversation(seed: int) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    return fresh(rng, 40), fresh(rng, 3)


def _second_turn(first: list[int], answer: list[int], new: list[int]) -> list[int]:
    return first + answer + new


@pytest.mark.parametrize(("writer", "reader", "spec"), PAIRS, ids=[f"{w}-to-{r}-{s}" for w, r, s in PAIRS])
def test_resume_from_another_engines_entry(arena, writer, reader, spec):
    first, new = _conversation(1)
    cold = make_engine("qwen3_5", reader, spec, cache=False)
    cold_first = _run(cold, "c1", first)
    second = _second_turn(first, cold_first.tokens, new)
    cold_second = _run(cold, "c2", second)

    a = make_engine("qwen3_5", writer, spec, host_tier_name=arena.name)
    assert _run(a, "a1", first).tokens == cold_first.tokens
    b = make_engine("qwen3_5", reader, spec, host_tier_name=arena.name)
    hot = _run(b, "b2", second)
    # the writer's end of turn one: prompt + answer but the last answer token (never fed)
    assert hot.cached == len(first) + MAX_TOKENS - 1
    assert hot.tokens == cold_second.tokens
    np.testing.assert_allclose(hot.logprobs, cold_second.logprobs, atol=1e-5)
    stats = b.runner.prefix_cache_stats()
    assert stats["host_hit_tokens"] == hot.cached


def test_another_salts_engine_finds_no_entry(arena):
    """Entries keep their request's cache salt: another engine resumes a salted turn only for the same salt (with
    the cold run's tokens); another salt and no salt find nothing in the tier."""
    first, new = _conversation(3)
    a = make_engine("qwen3_5", "native", {}, host_tier_name=arena.name)
    answer = _run(a, "a1", first, "tenant-a").tokens
    second = _second_turn(first, answer, new)
    cold = _run(make_engine("qwen3_5", "native", {}, cache=False), "c2", second)
    for salt in ("tenant-b", None):
        b = make_engine("qwen3_5", "native", {}, host_tier_name=arena.name)
        miss = _run(b, "b2", second, salt)
        assert miss.cached == 0 and b.runner.prefix_cache_stats()["host_hit_tokens"] == 0
        assert miss.tokens == cold.tokens
    c = make_engine("qwen3_5", "native", {}, host_tier_name=arena.name)
    hit = _run(c, "c2", second, "tenant-a")
    assert hit.cached == len(first) + MAX_TOKENS - 1 and hit.tokens == cold.tokens


def test_zeroed_entry_changes_the_output(arena):
    first, new = _conversation(2)
    a = make_engine("qwen3_5", "native", {}, host_tier_name=arena.name)
    answer = _run(a, "a1", first).tokens
    second = _second_turn(first, answer, new)
    b = make_engine("qwen3_5", "native", {}, host_tier_name=arena.name)
    good = _run(b, "b2", second)
    assert good.cached == len(first) + MAX_TOKENS - 1
    # the same request on a fresh engine, after every entry's state and KV bytes were zeroed
    for section in _sections(arena):
        desc_end = -(-(4 + int(np.frombuffer(section[:4].tobytes(), "<u4")[0])) // 64) * 64
        section[desc_end:] = 0
    c = make_engine("qwen3_5", "native", {}, host_tier_name=arena.name)
    bad = _run(c, "c2", second)
    assert bad.cached == good.cached
    assert np.abs(np.asarray(bad.logprobs) - np.asarray(good.logprobs)).max() > 1e-3


def _sections(arena: HostArena):
    """Each READY entry's (one) section: a writable view of shared memory."""
    for index in np.flatnonzero(arena.entries["state"] == READY):
        record = arena.entries[index]
        start = int(record["first_block"]) * arena.block_bytes + head_bytes(int(record["num_tokens"]))
        yield arena.data[start : start + int(record["shard_bytes"])]


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda section: section.__setitem__(slice(4, 64), 0xC1),
        lambda section: section.__setitem__(slice(0, 4), 0xFF),
    ],
    ids=["garbage-descriptor", "descriptor-past-the-entry"],
)
def test_unreadable_entry_is_refused_not_imported(arena, corrupt):
    first, new = _conversation(4)
    cold = make_engine("qwen3_5", "native", {}, cache=False)
    answer = _run(cold, "c1", first).tokens
    second = _second_turn(first, answer, new)
    expected = _run(cold, "c2", second)
    writer = make_engine("qwen3_5", "native", {}, host_tier_name=arena.name)
    _run(writer, "w1", first)
    for section in _sections(arena):
        corrupt(section)
    reader = make_engine("qwen3_5", "native", {}, host_tier_name=arena.name)
    got = _run(reader, "r2", second)
    assert got.cached == 0 and got.tokens == expected.tokens
    assert reader.runner.prefix_cache.host.num_refused > 0


@pytest.mark.parametrize("background", [False, True])
def test_device_evictions_spill_and_come_back(single_arena, background):
    """`background`: the spills are copied out by the writer thread, as on a GPU (the evictions wait for them)."""
    arena = single_arena
    first, new = _conversation(3)
    cold = make_engine("qwen3_5", "replay", {}, cache=False)
    answer = _run(cold, "c1", first).tokens
    second = _second_turn(first, answer, new)
    cold_second = _run(cold, "c2", second)

    engine = make_engine("qwen3_5", "replay", {}, host_tier_name=arena.name)
    host = engine.runner.prefix_cache.host
    host.writer = SectionWriter(host.tier, background)
    assert _run(engine, "e1", first).tokens == answer
    # a single replica copies nothing while its device holds the checkpoints
    assert not (arena.entries["state"] == READY).any()
    engine.runner.evict_prefix_cache()
    assert engine.runner.prefix_cache.cache.num_checkpoints() == 0
    assert (arena.entries["state"] == READY).sum() > 0
    hot = _run(engine, "e2", second)
    assert hot.cached == len(first) + MAX_TOKENS - 1
    assert hot.tokens == cold_second.tokens
    np.testing.assert_allclose(hot.logprobs, cold_second.logprobs, atol=1e-5)
    # closing the runner lets the writer's threads go
    engine.runner.close()
    assert not host.writer._threads
    # twin: without the host tier the evicted prefix is recomputed
    bare = make_engine("qwen3_5", "replay", {})
    _run(bare, "x1", first)
    bare.runner.evict_prefix_cache()
    assert _run(bare, "x2", second).cached == 0


@pytest.mark.parametrize("staging_bytes", [1, section_writer.STAGING_BYTES], ids=["behind", "keeping-up"])
def test_spills_behind_the_writer_are_dropped_not_waited_for(single_arena, monkeypatch, staging_bytes):
    """A burst of evictions while the writer's first copy is held up: with room for one pending copy the first
    spill is queued and the others are dropped at once, counted, without waiting for it; the queued entry lands
    once its copy runs. Twin: with room for all, every spill is queued and lands."""
    gate = threading.Event()
    arena_view = section_writer._arena_view

    def held_up(region):
        gate.wait(60)
        return arena_view(region)

    monkeypatch.setattr(section_writer, "_arena_view", held_up)
    engine = make_engine("qwen3_5", "replay", {}, host_tier_name=single_arena.name)
    prefix = engine.runner.prefix_cache
    prefix.host.writer = SectionWriter(prefix.host.tier, background=True, staging_bytes=staging_bytes)
    _run(engine, "e1", _conversation(7)[0])
    engine.runner._flush_checkpoints()
    stored = prefix.cache.num_checkpoints()
    assert stored >= 3
    t0 = time.perf_counter()
    prefix.cache.evict()
    evict_s = time.perf_counter() - t0
    gate.set()
    prefix.host.flush()
    written = 1 if staging_bytes == 1 else stored
    assert evict_s < 30, f"the evictions waited {evict_s:.1f} s for the held-up copy"
    assert engine.runner.prefix_cache_stats()["host_entries_skipped"] == stored - written
    assert (single_arena.entries["state"] == READY).sum() == written
    engine.runner.close()


def test_a_checkpoint_dropped_before_it_is_written_is_not_spilled(single_arena, monkeypatch):
    """A step's checkpoints are written in one batch before the runner next touches the state; one evicted before
    that holds nothing of its node in the pool, so copying it to the host tier would store garbage."""
    engine = make_engine("qwen3_5", "replay", {}, host_tier_name=single_arena.name)
    prefix = engine.runner.prefix_cache
    saved = []
    monkeypatch.setattr(prefix.host, "save", lambda node: saved.append(node) or True)
    first, _ = _conversation(4)
    _run(engine, "a", first)
    # the finished request's last checkpoint is still waiting for the next flush
    pending = [node for _, node, *_ in prefix._unwritten]
    assert len(pending) == 1
    stored = prefix.cache.num_checkpoints()
    prefix.cache.evict()
    assert len(saved) == stored - 1 and not any(node is pending[0] for node in saved)
    # twin: written first, every dropped checkpoint spills
    second = make_engine("qwen3_5", "replay", {}, host_tier_name=single_arena.name)
    monkeypatch.setattr(second.runner.prefix_cache.host, "save", lambda node: saved.append(node) or True)
    saved.clear()
    _run(second, "b", first)
    second.runner.evict_prefix_cache()
    assert len(saved) == stored


def test_two_hits_admitted_together(arena):
    """Both imports go through one staging buffer in the same admission: each must own its state afterwards."""
    convs = [_conversation(10 + i) for i in range(2)]
    cold = make_engine("qwen3_5", "replay", {"mtp_step": 2}, cache=False)
    writer = make_engine("qwen3_5", "native", {"mtp_step": 2}, host_tier_name=arena.name)
    seconds, expected = [], []
    for i, (first, new) in enumerate(convs):
        answer = _run(writer, f"w{i}", first).tokens
        seconds.append(_second_turn(first, answer, new))
        expected.append(_run(cold, f"c{i}", seconds[-1]))
    reader = make_engine("qwen3_5", "replay", {"mtp_step": 2}, host_tier_name=arena.name)
    results = {f"r{i}": Result() for i in range(2)}
    for i, prompt in enumerate(seconds):
        submit(reader, f"r{i}", prompt, MAX_TOKENS)
    drain(reader, results)
    for i in range(2):
        hot = results[f"r{i}"]
        assert hot.cached == len(convs[i][0]) + MAX_TOKENS - 1
        assert hot.tokens == expected[i].tokens
        np.testing.assert_allclose(hot.logprobs, expected[i].logprobs, atol=1e-5)


def test_eviction_under_pressure_keeps_outputs_right():
    """A tier of three 1 MiB blocks (one entry each): the second conversation's entries push the first's out; the
    first's next turn misses (recomputes, cold tokens), the second's resumes."""
    small = HostArena.create(f"lightllm-test-{uuid.uuid4().hex}", 3 << 20, block_bytes=1 << 20, max_entries=16)
    try:
        convs = [_conversation(20 + i) for i in range(2)]
        cold = make_engine("qwen3_5", "native", {}, cache=False)
        writer = make_engine("qwen3_5", "native", {}, host_tier_name=small.name)
        seconds, expected = [], []
        for i, (first, new) in enumerate(convs):
            answer = _run(writer, f"w{i}", first).tokens
            seconds.append(_second_turn(first, answer, new))
            expected.append(_run(cold, f"c{i}", seconds[-1]).tokens)
        assert writer.runner.prefix_cache_stats()["host_entries_evicted"] > 0
        assert (small.entries["state"] == READY).sum() == 3
        reader = make_engine("qwen3_5", "native", {}, host_tier_name=small.name)
        # the kept one first: the reader's own publishes write entries too (and evict)
        kept, evicted = _run(reader, "r1", seconds[1]), _run(reader, "r0", seconds[0])
        assert evicted.cached == 0 and evicted.tokens == expected[0]
        assert kept.cached == len(convs[1][0]) + MAX_TOKENS - 1 and kept.tokens == expected[1]
    finally:
        small.unlink()


def test_a_tier_smaller_than_one_entry_says_so(caplog):
    tiny = HostArena.create(f"lightllm-test-{uuid.uuid4().hex}", 4096, block_bytes=4096, max_entries=4)
    try:
        engine = make_engine("qwen3_5", "native", {}, host_tier_name=tiny.name)
        first, _ = _conversation(6)
        with caplog.at_level("WARNING"):
            _run(engine, "e1", first)
        assert sum("cannot hold the state" in r.getMessage() for r in caplog.records) == 1
        assert not (tiny.entries["state"] == READY).any()
    finally:
        tiny.unlink()
