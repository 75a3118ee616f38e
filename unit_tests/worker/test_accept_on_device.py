"""`ModelRunner.accept_on_device` / `settle` against `accept` + `draft` on a twin runner (tiny Qwen3.5 with an MTP
head, decode and draft buffers run eagerly on the CPU), every KV slot not yet written filled with
garbage (different in each runner) and the linear-state slots no request holds with NaN: a step whose
counts stay on the device drafts what the synchronous accept drafts; the next step, with a row removed and the
others reordered while those counts are still unread, gives the logits of the synchronous runner (its positions and
KV slots shifted on the device); a step whose rows all accepted nothing (counts of 1) is released a step later; the
runners agree once settled, and every KV slot comes back. Twin: the next step run as if the in-flight counts were
other ones gives other logits."""

from __future__ import annotations

import pytest
import torch

from lightllm.engine.batch import ForwardBatch
from lightllm.engine.speculative.verify import verify_full_windows_on_device
from unit_tests.models.test_device_drafts_engine import _engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MTP_STEP = 2
W = MTP_STEP + 1
PROMPTS = [[5, 6, 7, 8, 9], list(range(30, 41)), [3, 1, 4, 1, 5, 9, 2]]


def _runner(mode: str, seed: int):
    runner = _engine(mode, MTP_STEP, fixed_buffers=True, max_running_requests=4).runner
    gen = torch.Generator().manual_seed(seed)
    for kv in (runner.kv, runner.drafter.kv):
        for buf in kv.buffers:
            # every slot but HOLD, differently in each runner: a read of a slot no step wrote changes the logits
            buf[:, : kv.capacity] = torch.randn(buf[:, : kv.capacity].shape, generator=gen) * 100
    return runner


def _poison_free_slots(runner, slots: list[int]) -> None:
    """NaN in every float per-slot tensor of the linear state at `slots` (slots no live request holds)."""
    for tensor, slot_dim in runner.state._per_slot_tensors():
        if tensor.is_floating_point():
            tensor.index_fill_(slot_dim, torch.tensor(slots), float("nan"))


def _prefill(runner) -> tuple[list[int], torch.Tensor]:
    handles = [runner.add_request() for _ in PROMPTS]
    ids = torch.tensor([t for p in PROMPTS for t in p], dtype=torch.long)
    lens = [len(p) for p in PROMPTS]
    fwd = runner.forward(ForwardBatch(handles, lens, [0] * len(PROMPTS), len(PROMPTS), ids))
    first = fwd.logits.argmax(dim=-1)
    runner.draft(handles, first, MTP_STEP)
    return handles, first


def _decode(runner, handles, first: torch.Tensor, drafts: torch.Tensor):
    window = torch.cat([first[:, None], drafts], dim=1).reshape(-1)
    cached = [runner.num_tokens(h) for h in handles]
    return runner.forward(ForwardBatch(handles, [W] * len(handles), cached, 0, window))


@pytest.mark.parametrize("mode", ["native", "compact", "replay"])
@pytest.mark.parametrize("kept", [[0, 2, 1], [0, 0, 0]], ids=["mixed", "nothing-accepted"])
def test_accept_on_device_equals_accept_then_draft(mode, kept):
    gen = torch.Generator().manual_seed(7)
    overlapped, synchronous = _runner(mode, 1), _runner(mode, 2)
    free_before = [(r.kv.num_free_tokens(), r.drafter.kv.num_free_tokens()) for r in (overlapped, synchronous)]
    handles, first = _prefill(overlapped)
    handles_sync, first_sync = _prefill(synchronous)
    assert handles == handles_sync and torch.equal(first, first_sync)
    held = {overlapped._requests[h].state_slot for h in handles}
    free_slots = [s for s in range(overlapped.state.hold_slot) if s not in held]
    for runner in (overlapped, synchronous):
        _poison_free_slots(runner, free_slots)
    vocab = overlapped.vocab_size
    drafts = torch.randint(0, vocab, (3, MTP_STEP), generator=gen)

    # step s: counts on the device (overlapped) vs read and accepted (synchronous)
    fwd = _decode(overlapped, handles, first, drafts)
    fwd_sync = _decode(synchronous, handles, first, drafts)
    assert torch.equal(fwd.logits, fwd_sync.logits)
    counts, next_tokens, pairs, bad = verify_full_windows_on_device(fwd.logits, drafts, torch.tensor(kept))
    assert not bad.any()
    head_drafts = overlapped.accept_on_device(handles, counts, pairs)
    synchronous.accept(handles, counts.tolist())
    assert torch.equal(head_drafts, synchronous.draft(handles, next_tokens, MTP_STEP))
    # the host has not counted anything yet
    assert [overlapped.num_tokens(h) for h in handles] == [len(p) for p in PROMPTS]

    # step s + 1: row 1 leaves, rows 2 and 0 swap places, while step s's counts are unread
    left = overlapped._requests[handles[1]].state_slot
    for runner in (overlapped, synchronous):
        runner.free_request(handles[1])
        _poison_free_slots(runner, [left])
    order = [2, 0]
    rows = [handles[i] for i in order]
    drafts_next = torch.randint(0, vocab, (2, MTP_STEP), generator=gen)
    fwd = _decode(overlapped, rows, next_tokens[order], drafts_next)
    fwd_sync = _decode(synchronous, rows, next_tokens[order], drafts_next)
    assert torch.isfinite(fwd.logits).all()
    assert torch.allclose(fwd.logits, fwd_sync.logits, atol=1e-5, rtol=0)
    counts_next, tokens_next, pairs_next, _ = verify_full_windows_on_device(
        fwd.logits, drafts_next, torch.tensor([1, 0])
    )
    head_next = overlapped.accept_on_device(rows, counts_next, pairs_next)
    overlapped.settle(handles, counts.tolist())
    synchronous.accept(rows, counts_next.tolist())
    assert torch.equal(head_next, synchronous.draft(rows, tokens_next, MTP_STEP))
    overlapped.settle(rows, counts_next.tolist())

    # settled: the same committed lengths, and the next synchronous step of both is the same
    assert [overlapped.num_tokens(h) for h in rows] == [synchronous.num_tokens(h) for h in rows]
    fwd = _decode(overlapped, rows, tokens_next, head_next)
    fwd_sync = _decode(synchronous, rows, tokens_next, head_next)
    assert torch.isfinite(fwd.logits).all()
    assert torch.allclose(fwd.logits, fwd_sync.logits, atol=1e-5, rtol=0)
    for runner in (overlapped, synchronous):
        runner.accept(rows, [1, 1])
        for h in rows:
            runner.free_request(h)
        runner.evict_prefix_cache()
    assert [(r.kv.num_free_tokens(), r.drafter.kv.num_free_tokens()) for r in (overlapped, synchronous)] == free_before


def test_accept_on_device_twin_other_counts_in_flight():
    """Twin: the synchronous runner accepts other counts than those left on the device: the next step differs."""
    overlapped, synchronous = _runner("replay", 1), _runner("replay", 2)
    handles, first = _prefill(overlapped)
    _prefill(synchronous)
    drafts = torch.randint(0, overlapped.vocab_size, (3, MTP_STEP), generator=torch.Generator().manual_seed(7))
    fwd = _decode(overlapped, handles, first, drafts)
    _decode(synchronous, handles, first, drafts)
    counts, next_tokens, pairs, _ = verify_full_windows_on_device(fwd.logits, drafts, torch.tensor([0, 2, 1]))
    overlapped.accept_on_device(handles, counts, pairs)
    synchronous.accept(handles, [2, 1, 3])
    synchronous.draft(handles, next_tokens, MTP_STEP)
    same = torch.randint(0, overlapped.vocab_size, (3, MTP_STEP), generator=torch.Generator().manual_seed(8))
    fwd = _decode(overlapped, handles, next_tokens, same)
    fwd_sync = _decode(synchronous, handles, next_tokens, same)
    assert not torch.allclose(fwd.logits, fwd_sync.logits, atol=1e-5, rtol=0)


def test_a_refused_settle_leaves_the_step_to_settle_again():
    """Counts outside [1, W] are refused before anything changes: the same step then settles, and a second settle
    finds nothing (twin: the counts it would have taken are not applied twice)."""
    runner = _runner("native", 1)
    handles, first = _prefill(runner)
    drafts = torch.randint(0, runner.vocab_size, (3, MTP_STEP), generator=torch.Generator().manual_seed(7))
    fwd = _decode(runner, handles, first, drafts)
    counts, _, pairs, _ = verify_full_windows_on_device(fwd.logits, drafts, torch.tensor([0, 2, 1]))
    runner.accept_on_device(handles, counts, pairs)
    lengths = [runner.num_tokens(h) for h in handles]
    for bad in ([1, W + 1, 1], [1, 0, 1], [1, 1]):
        with pytest.raises(ValueError, match="outside"):
            runner.settle(handles, bad)
        assert [runner.num_tokens(h) for h in handles] == lengths
    runner.settle(handles, counts.tolist())
    assert [runner.num_tokens(h) for h in handles] == [n + c for n, c in zip(lengths, counts.tolist())]
    with pytest.raises(RuntimeError, match="without a step"):
        runner.settle(handles, counts.tolist())


def test_draft_phases_sit_after_the_pairs_the_device_counted():
    """The draft buffers of a step accepted on the device, for three drafts (two chained phases after the commit):
    the commit phase holds row i's counts[i] pairs after its committed ones (the last one's row read as the
    drafts' start), and row i's phase p >= 1 reads at `mtp_len[i] + counts[i] + p - 1` (positions one past it, the KV write slot of
    that column of the row's table, that many cached pairs), every phase written at once from the device counts;
    checked against values the test computes from the counts it chose."""
    steps = 3
    runner = _engine("replay", steps, fixed_buffers=True, max_running_requests=4).runner
    handles = [runner.add_request() for _ in PROMPTS]
    ids = torch.tensor([t for p in PROMPTS for t in p], dtype=torch.long)
    fwd = runner.forward(ForwardBatch(handles, [len(p) for p in PROMPTS], [0] * 3, 3, ids))
    first = fwd.logits.argmax(dim=-1)
    runner.draft(handles, first, steps)
    drafts = torch.randint(0, runner.vocab_size, (3, steps), generator=torch.Generator().manual_seed(3))
    window = torch.cat([first[:, None], drafts], dim=1).reshape(-1)
    cached = [runner.num_tokens(h) for h in handles]
    fwd = runner.forward(ForwardBatch(handles, [steps + 1] * 3, cached, 0, window))
    kept = torch.tensor([2, 0, 3])
    counts, _, pairs, _ = verify_full_windows_on_device(fwd.logits, drafts, kept)
    mtp_len = [runner._requests[h].mtp_len for h in handles]
    runner.accept_on_device(handles, counts, pairs)
    graphs = runner.drafter.graphs
    # the commit phase: row i commits counts[i] pairs after its mtp_len (padding places at its first position)
    w = steps + 1
    start = torch.tensor(mtp_len)
    cols = torch.arange(w)[None, :]
    real = cols < counts[:, None]
    positions = torch.where(real, start[:, None] + cols, start[:, None]) + 1
    assert graphs._i64[graphs._field64(0, "positions"), : 3 * w].view(3, w).tolist() == positions.tolist()
    assert graphs._i64[graphs._field64(0, "real"), : 3 * w].view(3, w).tolist() == real.long().tolist()
    assert graphs._i32[graphs._field32(0, "query_len"), :3].tolist() == counts.tolist()
    assert graphs._i32[graphs._field32(0, "num_cached"), :3].tolist() == mtp_len
    assert graphs._i64[1, :3].tolist() == [i * w + int(c) - 1 for i, c in enumerate(counts)]
    for phase in range(1, steps):
        at = torch.tensor([m + int(c) + phase - 1 for m, c in zip(mtp_len, counts)])
        positions = graphs._i64[graphs._field64(phase, "positions"), :3]
        write_slots = graphs._i64[graphs._field64(phase, "write_slots"), :3]
        num_cached = graphs._i32[graphs._field32(phase, "num_cached"), :3]
        assert positions.tolist() == (at + 1).tolist(), phase
        assert num_cached.tolist() == at.tolist(), phase
        assert write_slots.tolist() == runner.drafter.kv.req_to_slot[torch.tensor(handles), at].tolist(), phase
    runner.settle(handles, counts.tolist())
