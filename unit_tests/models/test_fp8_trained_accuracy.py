"""Block-FP8 on a trained model: the demo checkpoint quantized by the test (128 x 128 and 64 x 32 blocks), its logits
against the dequantized-weight model's (the same weights, activations unrounded) on 512 positions of held-out text.
W8A8's activation rounding moves logits by a few percent, so it may swap two candidates that are nearly tied (this
small model has many: its own bf16 and dequantized-weight forms disagree on ~6% of positions), but wherever the
reference's top-1 leads by more than one logit the FP8 model must pick the same token."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer

from lightllm.engine.batch import ForwardBatch
from lightllm.tools.demo_model import trained_model_dir
from lightllm.tools.demo_model.corpus import heldout_documents
from lightllm.tools.quantize_fp8 import dequantize_checkpoint, quantize_checkpoint
from unit_tests.models.drive import make_runner

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NUM_POSITIONS = 512
# positions where the reference's top-1 logit leads the runner-up by this much (about half of them)
CONFIDENT_GAP = 1.0
MIN_CONFIDENT_AGREEMENT = 0.995
MIN_TOP1_AGREEMENT = 0.9


@pytest.fixture(scope="module")
def demo_dir():
    path = trained_model_dir()
    assert path is not None, "the trained demo checkpoint is part of the package (lightllm/tools/demo_model/weights)"
    return path


@pytest.fixture(scope="module")
def heldout_ids(demo_dir) -> torch.Tensor:
    tokenizer = Tokenizer.from_file(str(demo_dir / "tokenizer.json"))
    text = "".join(doc.text for doc in heldout_documents())
    ids = tokenizer.encode(text).ids
    start = len(ids) // 3  # past the module docstrings the held-out files open with
    return torch.tensor(ids[start : start + NUM_POSITIONS], dtype=torch.long)


def prompt_logits(model_dir, ids: torch.Tensor) -> torch.Tensor:
    runner = make_runner(str(model_dir), max_req_total_len=len(ids) + 8, max_total_token_num=len(ids) + 64)
    handle = runner.add_request()
    out = runner.forward(ForwardBatch([handle], [len(ids)], [0], 1, ids, [True], [True]))
    return out.prompt_logits


def agreement(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (actual.argmax(-1) == expected.argmax(-1)).float().mean().item()


def confident_agreement(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, int]:
    """Top-1 agreement over the positions where `expected` leads by more than CONFIDENT_GAP, and their count."""
    top2 = expected.float().topk(2, dim=-1).values
    confident = top2[:, 0] - top2[:, 1] > CONFIDENT_GAP
    same = actual.argmax(-1) == expected.argmax(-1)
    return same[confident].float().mean().item(), int(confident.sum())


@pytest.mark.parametrize("block", [(128, 128), (64, 32)], ids=["b128", "b64x32"])
def test_fp8_top1_follows_the_dequantized_weight_model_on_held_out_text(demo_dir, heldout_ids, tmp_path, block):
    fp8 = quantize_checkpoint(demo_dir, tmp_path / "fp8", block)
    reference = dequantize_checkpoint(fp8, tmp_path / "dequantized")
    actual, expected = prompt_logits(fp8, heldout_ids), prompt_logits(reference, heldout_ids)
    assert actual.shape == expected.shape == (NUM_POSITIONS, expected.shape[-1])
    top1, (confident, count) = agreement(actual, expected), confident_agreement(actual, expected)
    rel = ((actual - expected).norm() / expected.norm()).item()
    assert count > NUM_POSITIONS // 4, count
    assert confident >= MIN_CONFIDENT_AGREEMENT, f"top-1 agreement {confident:.4f} on {count} confident positions"
    assert top1 >= MIN_TOP1_AGREEMENT, f"top-1 agreement {top1:.4f} on {NUM_POSITIONS} positions, logits rel {rel:.4f}"
    # the two differ by the activation rounding only: not by a hair, and by no more than e4m3's few percent
    assert 1e-4 < rel < 0.05, rel


def test_teeth_a_model_with_one_scale_block_wrong_disagrees(demo_dir, heldout_ids, tmp_path):
    """The same comparison with one scale block of each layer-0 FP8 matrix scaled by 4: the confident-position
    check above must be able to fail."""
    from safetensors.torch import load_file, save_file

    fp8 = quantize_checkpoint(demo_dir, tmp_path / "fp8", (128, 128))
    tensors = load_file(fp8 / "model.safetensors")
    for name in sorted(tensors):
        if name.endswith("weight_scale_inv") and "layers.0." in name:
            tensors[name][0, 0] *= 4.0
    save_file(tensors, fp8 / "model.safetensors", metadata={"format": "pt"})
    broken = prompt_logits(fp8, heldout_ids)
    reference = prompt_logits(
        dequantize_checkpoint(quantize_checkpoint(demo_dir, tmp_path / "ok", (128, 128)), tmp_path / "deq"), heldout_ids
    )
    assert confident_agreement(broken, reference)[0] < MIN_CONFIDENT_AGREEMENT
