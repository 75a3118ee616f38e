"""No kernel compiles in the middle of serving: the compile key of every Triton launch a serving step makes (see
`unit_tests.helpers.launch_keys`) depends only on the model and the step's kind, never on how many rows or tokens
the batch has or where its per-row metadata sits in the step's buffers.

On a GPU a new key is a compile (seconds for the attention and state kernels) inside that step: before the
kernels stopped specialising on their per-row tables and counts, the first rounds of a real-width benchmark spent
seconds compiling variants of `paged_attention_kernel`, `serial_verify_kernel`, `causal_conv_decode_kernel` and
`native_accept_kernel` for batch sizes the start-up had not met. Here a tiny model runs its Triton kernels under
the interpreter through steps of many shapes: prefill alone, decode of 1, 2, 3, 4, 5, 16 and 17 rows (through the
decode buffers that graphs are captured over), and mixed steps of prefill chunks of 1 to 21 tokens beside decode
rows.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from lightllm.engine.batch import ForwardBatch
from lightllm.models.layers.attention import GatedAttention
from lightllm.models.layers.mla import LatentAttention
from lightllm.worker.warmup_steps import warm_attention_kernels, warm_serving_steps
from unit_tests.helpers.launch_keys import LaunchKeys, launch_keys
from unit_tests.models.conftest import MODEL_CASES, case_dir
from unit_tests.models.drive import make_runner

NUM_REQUESTS = 17


def _triton_runner(model_dir: str, mode: str, width: int, mtp_step: int = 0):
    runner = make_runner(
        model_dir,
        mode=mode,
        max_width=width,
        mtp_step=mtp_step,
        state_backend="triton",
        max_running_requests=NUM_REQUESTS + 1,
        max_total_token_num=2048,
    )
    for module in runner.model.modules():
        if isinstance(module, (GatedAttention, LatentAttention)):
            module.attention_backend = "triton"
    return runner


def _missing(served: LaunchKeys, *warmed: LaunchKeys) -> dict[str, int]:
    """Per kernel, how many (constexpr, runtime) keys of `served` no warm-up met."""
    out = {}
    for kernel, by_const in served.by_kernel.items():
        for const, runtime in by_const.items():
            met = set().union(*(w.by_kernel[kernel][const] for w in warmed if kernel in w.by_kernel))
            if runtime - met:
                out[kernel] = out.get(kernel, 0) + len(runtime - met)
    return out


def _serve_steps(runner, width: int, seed: int = 0) -> None:
    """Steps of many shapes; decode rows verify windows of `width` and accept a random prefix; with an MTP head,
    every decode row then drafts `width - 1` tokens."""
    gen = torch.Generator().manual_seed(seed)
    handles = [runner.add_request() for _ in range(NUM_REQUESTS)]

    def step(prefill: list[tuple[int, int]], decode: list[int]) -> None:
        rows = [h for h, _ in prefill] + decode
        query_lens = [n for _, n in prefill] + [width] * len(decode)
        cached = [runner.num_tokens(h) for h in rows]
        ids = torch.randint(1, 400, (sum(query_lens),), generator=gen)
        runner.forward(ForwardBatch(rows, query_lens, cached, len(prefill), ids, [True] * len(prefill)))
        if decode:
            runner.accept(decode, torch.randint(1, width + 1, (len(decode),), generator=gen).tolist())
            if runner.drafter is not None:
                runner.draft(decode, torch.randint(1, 400, (len(decode),), generator=gen), width - 1)

    h = handles
    step([(h[0], 7)], [])
    step([(h[1], 21), (h[2], 16)], [])
    step([], h[:1])
    step([], h[:2])
    step([], h[:3])
    step([(h[3], 5)], h[:2])
    step([(h[4], 1), (h[5], 3)], h[:4])
    step([(r, 2) for r in h[6:]], [])
    step([], h[:16])
    step([], h[:5])
    step([(h[16], 4)], h[:16])
    step([], h[:17])
    # a prefix-cache publish or a prefill/decode hand-off exports checkpoints; a hit imports one
    runner.import_checkpoint(h[:3], runner.export_checkpoint(h[:3]))


@pytest.mark.parametrize(
    "model, mode, width, mtp_step",
    [("qwen3_next", "native", 1, 0), ("qwen3_5-hv2", "compact", 3, 2), ("kimi_linear", "replay", 3, 0)],
)
def test_serving_steps_meet_one_compile_key_per_kernel_variant_and_warmed_attention(
    tiny_model, model, mode, width, mtp_step
):
    """One key per kernel and constexpr variant over every step; every key a serving step meets was met at
    start-up: by the attention warm-up (scratch tensors at the model's paged and MLA latent attention shapes, the
    MTP head's included), the decode graphs' capture or the warm-up steps (`warm_serving_steps`). Without the
    warm-up steps, replay's standalone fold (in place before a chunk, into a copy at export) would first compile in
    a serving step."""
    model_dir = case_dir(model) if model in MODEL_CASES else str(tiny_model(model))
    runner = _triton_runner(model_dir, mode, width, mtp_step)
    latent = [m for m in runner.model.modules() if isinstance(m, LatentAttention)]
    with launch_keys() as warmed:
        # the start-up attention warm-up (`ModelRunner.warmup_attention` on CUDA)
        warm_attention_kernels(runner.model, torch.float32, "cpu")
        # decode-only steps (and MTP drafts) through the graphs' fixed buffers, eagerly (capture runs each once)
        runner.init_decode_graphs(use_graphs=False)
    free = (runner.num_free_requests(), runner.kv.num_free_tokens())
    with launch_keys() as warm_steps:
        warm_serving_steps(runner)
    # the warm-up requests gave their slots and KV back
    assert (runner.num_free_requests(), runner.kv.num_free_tokens()) == free
    with launch_keys() as served:
        _serve_steps(runner, width)
    assert _missing(served, warmed, warm_steps) == {}
    if mode == "replay":
        # the twin: the same serving steps against the start-up without its warm-up steps
        assert "replay_fold_kernel" in _missing(served, warmed)
    kernels = set(served.by_kernel)
    # MLA attends decode, verify and these short chunks in latent space
    attention = "mla_attention_kernel" if latent else "paged_attention_kernel"
    assert {attention, "causal_conv_decode_kernel", "causal_conv_prefill_kernel"} <= kernels
    state_kernels = {"replay_window_kernel", "replay_accept_kernel"} if mode == "replay" else {"serial_verify_kernel"}
    assert state_kernels <= kernels
    assert served.varying() == {}
    # kernels with no shape-driven constexpr: one compiled variant whatever the batch size
    for name in {"replay_accept_kernel", "native_accept_kernel", "causal_conv_decode_kernel"} & kernels:
        assert len(served.by_kernel[name]) == 1, f"{name}: {list(served.by_kernel[name])}"
    for const, runtime in served.by_kernel[attention].items():
        assert runtime <= warmed.by_kernel[attention][const], f"{dict(const)} is not warmed up"


def _scale_rows(x, slots, y, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    slot = tl.load(slots + offs, mask=mask, other=0)
    tl.store(y + offs, tl.load(x + slot, mask=mask, other=0.0) * 2.0, mask=mask)


def test_the_recorder_sees_a_kernel_that_specialises_on_the_batch():
    """The twin: one kernel launched for 1, 3 and 16 rows whose slot table starts at offsets 0, 1 and 4 of a packed
    buffer meets three keys (its row count and the table's alignment), and one key once it does not specialise on
    them; the outputs are right either way."""
    x = torch.randn(64)
    packed = torch.randperm(64).to(torch.int32)
    varying = []
    for kernel in (triton.jit(_scale_rows), triton.jit(do_not_specialize=["slots", "N"])(_scale_rows)):
        with launch_keys() as keys:
            for n, start in ((1, 0), (3, 1), (16, 4)):
                slots = packed[start : start + n]
                y = torch.full((n,), float("nan"))
                kernel[(1,)](x, slots, y, n, BLOCK=16)
                torch.testing.assert_close(y, x[slots.long()] * 2)
        varying.append(keys.varying())
    assert varying == [{"_scale_rows": ["N", "slots"]}, {}]
