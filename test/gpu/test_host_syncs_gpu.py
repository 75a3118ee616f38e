"""Step-path host work that must not wait for the device (a wait stalls the host behind the work it has just
launched, and the GPU then idles while the host prepares the next launch): sampling with temperature, top-k /
top-p and a greedy row in one batch, drawing the tokens, log-probabilities, a request's state slot at admission
and the export of its state for the prefix cache. Each runs under `torch.cuda.set_sync_debug_mode("error")` (after
one untimed call where a kernel launches for the first time) and equals the CPU's result."""

from __future__ import annotations

import pytest
import torch

from lightllm.cache.device_copy import list_to_device
from lightllm.engine.sampler import RowContext, Sampler, compute_logprobs
from lightllm.engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


class no_host_sync:
    def __enter__(self):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode("default")


def _rows() -> list[RowContext]:
    params = [
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.3, top_p=0.9, min_p=0.05),
        SamplingParams(temperature=0.9, seed=11),
    ]
    return [RowContext(p, [1, 2, 3], [4], torch.Generator("cuda").manual_seed(5) if p.seed else None) for p in params]


def test_sampling_waits_for_nothing_and_equals_the_cpu():
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(1)) * 3
    cpu_rows = [RowContext(r.params, r.prompt_ids, r.output_ids) for r in _rows()]
    expected = Sampler().target_probs(logits, cpu_rows)
    rows, on_gpu = _rows(), logits.cuda()
    with no_host_sync():
        probs = Sampler().target_probs(on_gpu, rows)
        tokens = Sampler().draw_tokens(probs, rows)
    torch.testing.assert_close(probs.cpu(), expected, rtol=1e-5, atol=1e-6)
    drawn = tokens.cpu()
    assert all(probs[i, int(t)].item() > 0 for i, t in enumerate(drawn)), "every draw is a token its row allows"
    assert int(drawn[1]) == int(logits[1].argmax())
    assert (expected[0] > 0).sum() == 5 and (expected[2] > 0).sum() < 300
    # twin: the debug mode catches a copy that waits (a tensor built on the device from a list)
    with no_host_sync(), pytest.raises(RuntimeError):
        torch.tensor([1, 2, 3], device="cuda")
    with no_host_sync():
        assert list_to_device([1, 2, 3], torch.long, "cuda") is not None


def test_logprobs_equal_the_cpu():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(2))
    expected = compute_logprobs(logits, [4, 7, 9], 2)
    got = compute_logprobs(logits.cuda(), [4, 7, 9], 2)
    torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(expected[0]), rtol=1e-5, atol=1e-5)
    assert [[t for t, _ in top] for top in got[1]] == [[t for t, _ in top] for top in expected[1]]


@pytest.mark.parametrize("mode", ["native", "compact", "replay"])
def test_state_slot_and_checkpoint_export_wait_for_nothing(mode):
    from lightllm import LLM
    from lightllm.tools.make_tiny_model import tiny_model_dir

    with LLM(str(tiny_model_dir("qwen3_5")), device="cuda", ssm_state_mode=mode, mtp_step=1) as llm:
        state = llm.engine.runner.state

        def admit_and_export():
            slot = state.alloc()
            ckpt = state.export_checkpoint(torch.full((1,), slot, dtype=torch.int32, device="cuda"))
            return slot, ckpt

        # once outside the check: a kernel's first launch loads its module (and may tune it), once per process
        state.free(admit_and_export()[0])
        with no_host_sync():
            slot, ckpt = admit_and_export()
        assert ckpt.ssm.abs().sum().item() == 0, "a fresh slot exports the zero state"
        state.free(slot)
