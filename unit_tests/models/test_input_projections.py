"""Each token mixer reads its input with one GEMM: gated attention's q (with its gate), k and v, MLA's query heads
and latent projection, KDA's q / k / v / b with its low-rank gate inputs, GDN's q / k / v / z / b / a (two when an
FP8 model keeps b / a unquantized, as Qwen's releases do). Counted on a real prefill and decode of each tiny
architecture: every GEMM (`F.linear`, or the block-FP8 linear of an FP8 weight) whose input is the very tensor the
mixer was called with."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from lightllm.models.layers import quantized_linear
from lightllm.models.layers.attention import GatedAttention
from lightllm.models.layers.gdn import GatedDeltaNet
from lightllm.models.layers.kda import KimiDeltaAttention
from lightllm.models.layers.mla import LatentAttention
from lightllm.tools.quantize_fp8 import quantize_checkpoint
from unit_tests.models.conftest import ARCH_CASES
from unit_tests.models.drive import decode, make_runner, prefill

MIXERS = (GatedAttention, GatedDeltaNet, KimiDeltaAttention, LatentAttention)


class _LinearInputs(TorchFunctionMode):
    """Records the input tensor of every `F.linear` call (and, through `fp8_linear`, of every block-FP8 one)."""

    def __init__(self):
        super().__init__()
        self.inputs: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.linear:
            self.inputs.append(args[0])
        return func(*args, **(kwargs or {}))

    def fp8_linear(self, fp8_block_linear):
        def recorded(x, *args, **kwargs):
            self.inputs.append(x)
            return fp8_block_linear(x, *args, **kwargs)

        return recorded


def gemms_reading_the_input(model_dir, monkeypatch) -> dict[str, list[int]]:
    """Mixer class name -> per call (prefill, then one decode step, every layer): the GEMMs whose input is the
    mixer's own input tensor."""
    runner = make_runner(str(model_dir))
    calls: list[tuple[str, torch.Tensor, int]] = []
    recorder = _LinearInputs()
    monkeypatch.setattr(quantized_linear, "fp8_block_linear", recorder.fp8_linear(quantized_linear.fp8_block_linear))

    def before(module, args):
        calls.append((type(module).__name__, args[0], len(recorder.inputs)))

    hooks = [m.register_forward_pre_hook(before) for m in runner.model.modules() if isinstance(m, MIXERS)]
    handle = runner.add_request()
    with recorder:
        token = int(prefill(runner, handle, list(range(3, 14))).argmax())
        decode(runner, handle, token)
    for h in hooks:
        h.remove()
    counts: dict[str, list[int]] = {}
    ends = [start for _, _, start in calls[1:]] + [len(recorder.inputs)]
    for (name, x, start), end in zip(calls, ends):
        counts.setdefault(name, []).append(sum(t is x for t in recorder.inputs[start:end]))
    return counts


@pytest.mark.parametrize("case", ARCH_CASES)
def test_every_mixer_reads_its_input_with_one_gemm(tiny, case, monkeypatch):
    counts = gemms_reading_the_input(tiny(case)[0], monkeypatch)
    assert counts, "no mixer ran"
    for name, per_call in counts.items():
        assert per_call == [1] * len(per_call), f"{name}: GEMMs reading the layer input per call: {per_call}"


def test_twin_gdn_with_b_a_unquantized_reads_its_input_twice(tiny, tmp_path, monkeypatch):
    """An FP8 Qwen3-Next keeps GDN's b / a in the model dtype beside the FP8 q|k|v|z: two GEMMs read the input
    (the counter sees every one of them), while attention's stays one."""
    fp8 = quantize_checkpoint(tiny("qwen3_next-hv2")[0], tmp_path / "fp8", (32, 32))
    counts = gemms_reading_the_input(fp8, monkeypatch)
    assert set(counts["GatedDeltaNet"]) == {2}, counts
    assert set(counts["GatedAttention"]) == {1}, counts
