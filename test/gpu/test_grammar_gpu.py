"""Constrained decoding on CUDA: grammar masks reach the logits without a host sync (so an overlapped step masks
while its forward runs) and equal the CPU's; constrained output with overlap scheduling on equals overlap off,
token for token, through CUDA graphs, per state mode (`test/e2e/test_structured_output.py` is the CPU suite)."""

from __future__ import annotations

import pytest
import torch

from lightllm.engine.grammar import GrammarBackend, mask_windows
from lightllm.engine.request import Request
from lightllm.engine.sampling_params import SamplingParams
from lightllm.server.grammar_vocab import load_grammar_vocabulary
from lightllm.tools.make_tiny_model import tiny_model_dir
from unit_tests.helpers.constrained import GRAMMAR, counting_launches, make_engine, mixed_requests, staggered, valid

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _windows(vocab: int):
    """A free row, two plain constrained rows (one advanced into its object) and a drafted window."""
    from transformers import AutoTokenizer

    model_dir = str(tiny_model_dir("qwen3_5"))
    hf = AutoTokenizer.from_pretrained(model_dir)
    backend = GrammarBackend(vocab, load_grammar_vocabulary)
    text = hf.encode('{"n": 12, "tag": "red", "ok": true}')

    def constrained(rid: str, emitted: list[int]) -> Request:
        req = Request(rid, [1], SamplingParams(grammar=GRAMMAR), frozenset(), 64)
        req.grammar = backend.matcher(GRAMMAR, None, model_dir, [hf.eos_token_id])
        assert req.grammar.advance(emitted) is None
        return req

    free = Request("free", [1], SamplingParams(), frozenset(), 64)
    return [
        (free, 0, 1, []),
        (constrained("a", []), 1, 1, []),
        (constrained("b", text[:3]), 2, 1, []),
        (constrained("c", text[:1]), 3, 4, text[1:4]),
    ]


def test_masks_reach_the_device_without_a_host_sync_and_equal_the_cpu():
    vocab = 512
    windows = _windows(vocab)
    logits = torch.randn(7, vocab, generator=torch.Generator().manual_seed(3))
    on_cpu = mask_windows(windows, logits)
    on_gpu_logits = logits.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        on_gpu = mask_windows(windows, on_gpu_logits)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(on_gpu.cpu(), on_cpu)
    assert torch.isinf(on_cpu[1:]).any(dim=-1).all() and torch.equal(on_cpu[0], logits[0])
    # twin: the debug mode catches a copy that waits for the device (a tensor built on it from a list)
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):
            torch.tensor([1, 2, 3], device="cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("mode", ["native", "replay"])
def test_constrained_overlap_equals_sync_through_graphs(mode):
    engine, info, tok = make_engine("qwen3_5", mode, device="cuda", disable_overlap_schedule=True)
    reference = staggered(engine, info, tok, mixed_requests())
    engine, info, tok = make_engine("qwen3_5", mode, device="cuda")
    launches = counting_launches(engine)
    overlapped = staggered(engine, info, tok, mixed_requests())
    assert overlapped == reference and sum(launches) >= 10
    eos = set(tok.eos_token_ids)
    for rid, (ids, reason) in overlapped.items():
        if rid != "free":
            assert reason == "stop" and valid(tok.decode([t for t in ids if t not in eos])), rid


def test_reused_pinned_bitmask_across_steps_without_a_host_sync():
    """Consecutive steps reuse the pinned host bitmask once its copy has completed (queried, never waited on), with
    no host sync, and each step's masks equal the CPU's; a buffer whose copy is still queued is not rewritten."""
    vocab = 512
    windows = _windows(vocab)
    gen = torch.Generator().manual_seed(5)
    steps = [torch.randn(7, vocab, generator=gen) for _ in range(3)]
    expected = [mask_windows(windows, logits) for logits in steps]
    masks = windows[1][0].grammar.host_masks
    on_gpu = [logits.cuda() for logits in steps]
    torch.cuda.synchronize()
    # a long kernel queued ahead keeps the first copy in flight while the second step takes its buffer
    busy = torch.randn(4096, 4096, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(8):
            busy = busy @ busy
        first = mask_windows(windows, on_gpu[0])
        buffer_first = masks.last
        second = mask_windows(windows, on_gpu[1])
        buffer_second = masks.last
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    third = mask_windows(windows, on_gpu[2])
    assert buffer_second is not buffer_first, "a buffer whose copy is queued must not be rewritten"
    assert masks.last is buffer_second, "a buffer whose copy completed is reused"
    for got, want in zip((first, second, third), expected):
        assert torch.equal(got.cpu(), want)
    # twin: the steps' logits differ, so equal results are not one step's masks seen three times
    assert not torch.equal(expected[0], expected[1])


def test_the_device_waits_for_the_host_counter_and_a_deferred_job_masks_like_mask_windows():
    """The device wait `MaskJob` relies on: the stream is held until the host writes the counter (an event behind
    the wait stays pending), then runs; a deferred job applied before its masks exist gives `mask_windows`'s
    logits once started."""
    import threading
    import time

    from lightllm.engine.grammar_masks import HostBitmasks, MaskJob
    from lightllm.kernels.host_flag import HostFlag

    flag = HostFlag()
    target = flag.next_target()
    flag.wait_on_device(target)
    after = torch.cuda.Event()
    after.record()
    time.sleep(0.05)
    assert not after.query(), "the stream ran past a counter below its target"
    flag.set(target)
    after.synchronize()
    assert HostBitmasks().device_wait_works(torch.device("cuda"))

    windows = _windows(1024)
    logits = torch.randn(4 + 3, 1024, device="cuda")
    expected = mask_windows(windows, logits)
    job = MaskJob.of(windows, *logits.shape, logits.device)
    assert job.deferred
    masked = job.apply(logits)
    # the masks are filled only now, after the masked logits were queued
    threading.Timer(0.02, job.start).start()
    torch.cuda.synchronize()
    job.wait()
    assert torch.equal(masked, expected)
