"""`ModelRunner.verify_on_device` / `settle` against `forward` + `accept` + `draft` on a twin runner (tiny Qwen3.5
with an MTP head, its step buffers run eagerly on the CPU), every KV slot not yet written filled with garbage
(different in each runner) and the linear-state slots no request holds with NaN: a step whose counts stay on the
device keeps, emits and drafts what the synchronous step does; the next step, with a row removed and the others
reordered while those counts are still unread, gives the logits of the synchronous runner (its positions and KV
slots shifted on the device); a step whose rows all accepted nothing (counts of 1) is released a step later; the
runners agree once settled, and every KV slot comes back. Twins: the next step run as if the in-flight counts were
other ones gives other logits; a room of fewer drafts keeps fewer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightllm.engine.batch import ForwardBatch
from lightllm.engine.speculative.verify import verify_full_windows_on_device
from unit_tests.models.test_device_drafts_engine import _engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MTP_STEP = 2
W = MTP_STEP + 1
PROMPTS = [[5, 6, 7, 8, 9], list(range(30, 41)), [3, 1, 4, 1, 5, 9, 2]]
# a room no window reaches
ROOM = 100


def _runner(mode: str, seed: int, mtp_step: int = MTP_STEP):
    runner = _engine(mode, mtp_step, fixed_buffers=True, max_running_requests=4).runner
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


def _prefill(runner, mtp_step: int = MTP_STEP) -> tuple[list[int], torch.Tensor]:
    handles = [runner.add_request() for _ in PROMPTS]
    ids = torch.tensor([t for p in PROMPTS for t in p], dtype=torch.long)
    lens = [len(p) for p in PROMPTS]
    fwd = runner.forward(ForwardBatch(handles, lens, [0] * len(PROMPTS), len(PROMPTS), ids))
    first = fwd.logits.argmax(dim=-1)
    runner.draft(handles, first, mtp_step)
    return handles, first


def _decode(runner, handles, first: torch.Tensor, drafts: torch.Tensor):
    window = torch.cat([first[:, None], drafts], dim=1).reshape(-1)
    cached = [runner.num_tokens(h) for h in handles]
    return runner.forward(ForwardBatch(handles, [drafts.shape[1] + 1] * len(handles), cached, 0, window))


def _verify(runner, handles, first: torch.Tensor, drafts: torch.Tensor, kept, room=ROOM, keep_logits=True):
    """`verify_on_device` of these windows: (counts, next tokens, pairs, bad, head drafts, logits)."""
    windows = torch.cat([first[:, None], drafts], dim=1)
    n, w = windows.shape
    room = np.full(n, room, dtype=np.int64)
    figures, logits = runner.verify_on_device(handles, windows, room, np.asarray(kept, dtype=np.int64), keep_logits)
    assert figures.shape == (n, 2 * w + 2)
    return figures[:, w], figures[:, 0], figures[:, w + 2 :], figures[:, w + 1] != 0, figures[:, 1:w], logits


@pytest.mark.parametrize("mode", ["native", "compact", "replay"])
@pytest.mark.parametrize("kept", [[0, 2, 1], [0, 0, 0], [-1, -1, -1]], ids=["mixed", "nothing-accepted", "the-model's"])
def test_verify_on_device_equals_forward_accept_draft(mode, kept):
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
    if kept[0] < 0:
        # the model's own acceptance: drafts that follow its argmax for a while
        probe = _runner(mode, 3)
        truth = _decode(probe, *_prefill(probe), drafts).logits.argmax(-1).view(3, W)
        # row 0's first draft is the argmax after its first token, row 1's is not
        drafts[0, 0], drafts[1, 0] = truth[0, 0], (truth[1, 0] + 1) % vocab

    # step s: counts on the device (overlapped) vs read and accepted (synchronous)
    counts, next_tokens, pairs, bad, head_drafts, logits = _verify(overlapped, handles, first, drafts, kept)
    fwd_sync = _decode(synchronous, handles, first, drafts)
    assert torch.equal(logits, fwd_sync.logits)
    expected = verify_full_windows_on_device(fwd_sync.logits, drafts, None if kept[0] < 0 else torch.tensor(kept))
    for got, want in zip((counts, next_tokens, pairs, bad), expected):
        assert torch.equal(got, want.long())
    assert not bad.any()
    if kept[0] < 0:
        assert counts.tolist()[:2] == [2, 1]
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
    counts_next, tokens_next, _, _, head_next, logits = _verify(
        overlapped, rows, next_tokens[order], drafts_next, [1, 0]
    )
    fwd_sync = _decode(synchronous, rows, next_tokens[order], drafts_next)
    assert torch.isfinite(logits).all()
    assert torch.allclose(logits, fwd_sync.logits, atol=1e-5, rtol=0)
    assert counts_next.tolist() == [2, 1]
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


def test_verify_on_device_twin_other_counts_in_flight():
    """Twin: the synchronous runner accepts other counts than those left on the device: the next step differs."""
    overlapped, synchronous = _runner("replay", 1), _runner("replay", 2)
    handles, first = _prefill(overlapped)
    _prefill(synchronous)
    drafts = torch.randint(0, overlapped.vocab_size, (3, MTP_STEP), generator=torch.Generator().manual_seed(7))
    _, next_tokens, *_ = _verify(overlapped, handles, first, drafts, [0, 2, 1])
    _decode(synchronous, handles, first, drafts)
    synchronous.accept(handles, [2, 1, 3])
    synchronous.draft(handles, next_tokens, MTP_STEP)
    same = torch.randint(0, overlapped.vocab_size, (3, MTP_STEP), generator=torch.Generator().manual_seed(8))
    *_, logits = _verify(overlapped, handles, next_tokens, same, [0, 0, 0])
    fwd_sync = _decode(synchronous, handles, next_tokens, same)
    assert not torch.allclose(logits, fwd_sync.logits, atol=1e-5, rtol=0)


def test_room_caps_the_kept_drafts():
    """A window keeps at most `room` drafts less the tokens its row has in flight (a step near the request's limit
    never commits past it); twin: more room keeps what the drafts earn."""
    runner = _runner("replay", 1)
    handles, first = _prefill(runner)
    drafts = torch.randint(0, runner.vocab_size, (3, MTP_STEP), generator=torch.Generator().manual_seed(7))
    counts, next_tokens, _, _, head, _ = _verify(runner, handles, first, drafts, [2, 2, 2], room=2)
    assert counts.tolist() == [3, 3, 3]
    # in flight: 3 tokens a row; a room of 4 leaves 1 draft to keep in the next window, a room of 3 none
    windows = torch.cat([next_tokens[:, None], head], dim=1)
    figures, _ = runner.verify_on_device(handles, windows, np.asarray([4, 3, 100]), np.asarray([2, 2, 2]))
    assert figures[:, W].tolist() == [2, 1, 3]


def test_a_refused_settle_leaves_the_step_to_settle_again():
    """Counts outside [1, W] are refused before anything changes: the same step then settles, and a second settle
    finds nothing (twin: the counts it would have taken are not applied twice)."""
    runner = _runner("native", 1)
    handles, first = _prefill(runner)
    drafts = torch.randint(0, runner.vocab_size, (3, MTP_STEP), generator=torch.Generator().manual_seed(7))
    counts, *_ = _verify(runner, handles, first, drafts, [0, 2, 1])
    lengths = [runner.num_tokens(h) for h in handles]
    for bad in ([1, W + 1, 1], [1, 0, 1], [1, 1]):
        with pytest.raises(ValueError, match="outside"):
            runner.settle(handles, bad)
        assert [runner.num_tokens(h) for h in handles] == lengths
    runner.settle(handles, counts.tolist())
    assert [runner.num_tokens(h) for h in handles] == [n + c for n, c in zip(lengths, counts.tolist())]
    with pytest.raises(RuntimeError, match="without a step"):
        runner.settle(handles, counts.tolist())


def test_only_windows_of_the_buffers_width_run_on_the_device():
    """A batch of drafted rows may verify on the device at the buffers' width W, not at another width (a
    speculator drafting fewer tokens verifies synchronously), and not before its MTP pairs are drafted."""
    runner = _runner("replay", 1)
    handles = [runner.add_request() for _ in PROMPTS]
    ids = torch.tensor([t for p in PROMPTS for t in p], dtype=torch.long)
    fwd = runner.forward(ForwardBatch(handles, [len(p) for p in PROMPTS], [0] * 3, 3, ids))
    assert not runner.can_verify_on_device(handles, W)
    runner.draft(handles, fwd.logits.argmax(dim=-1), MTP_STEP)
    assert runner.can_verify_on_device(handles, W)
    assert not runner.can_verify_on_device(handles, W - 1) and not runner.can_verify_on_device(handles, W + 1)


def test_a_forward_of_an_unsettled_row_is_refused():
    """A synchronous step of a row whose counts are still on the device would run at the wrong positions: refused
    until `settle`, then it runs."""
    runner = _runner("replay", 1)
    handles, first = _prefill(runner)
    drafts = torch.randint(0, runner.vocab_size, (3, MTP_STEP), generator=torch.Generator().manual_seed(7))
    counts, next_tokens, _, _, head, _ = _verify(runner, handles, first, drafts, [1, 0, 2])
    with pytest.raises(RuntimeError, match="settle"):
        _decode(runner, handles, next_tokens, head)
    runner.settle(handles, counts.tolist())
    assert torch.isfinite(_decode(runner, handles, next_tokens, head).logits).all()


def test_draft_phases_sit_after_the_pairs_the_device_counted():
    """The draft buffers of a step accepted on the device, for three drafts (two chained phases after the commit):
    the commit phase holds row i's counts[i] pairs after its committed ones (the last one's row read as the
    drafts' start), and row i's phase p >= 1 reads at `mtp_len[i] + counts[i] + p - 1` (positions one past it, the
    KV write slot of that column of the row's table, that many cached pairs), every phase written at once from the
    device counts; HOLD rows of the bucket (three rows in a bucket of four) write only the HOLD slot. Checked
    against values the test computes from the counts it chose."""
    steps = 3
    runner = _runner("replay", 1, steps)
    handles, first = _prefill(runner, steps)
    drafts = torch.randint(0, runner.vocab_size, (3, steps), generator=torch.Generator().manual_seed(3))
    mtp_len = [runner._requests[h].mtp_len for h in handles]
    counts, *_ = _verify(runner, handles, first, drafts, [2, 0, 3])
    assert counts.tolist() == [3, 1, 4]
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
    hold = runner.drafter.kv.hold_slot
    for phase in range(steps):
        slots = graphs._i64[graphs._field64(phase, "write_slots")]
        # the HOLD row (the bucket's fourth)
        assert set(slots[3 * (w if phase == 0 else 1) : 4 * (w if phase == 0 else 1)].tolist()) == {hold}, phase
    for phase in range(1, steps):
        at = torch.tensor([m + int(c) + phase - 1 for m, c in zip(mtp_len, counts)])
        positions = graphs._i64[graphs._field64(phase, "positions"), :3]
        write_slots = graphs._i64[graphs._field64(phase, "write_slots"), :3]
        num_cached = graphs._i32[graphs._field32(phase, "num_cached"), :3]
        assert positions.tolist() == (at + 1).tolist(), phase
        assert num_cached.tolist() == at.tolist(), phase
        assert write_slots.tolist() == runner.drafter.kv.req_to_slot[torch.tensor(handles), at].tolist(), phase
    runner.settle(handles, counts.tolist())
