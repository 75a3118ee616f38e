"""Start-up warm-up through real steps, so that no kernel a serving step launches compiles after the server is ready.

The prefill warm-up (`lightllm.linear_att.warmup`) and the attention warm-up cover the kernels whose compile keys
follow the shapes (fla's chunk kernels, the attention tile variants), and graph capture compiles what the decode
and short-prefill graphs run. Some launches only a step's own sequence of calls reaches: the state's fold of a
request's pending history before its next prefill chunk (replay: `replay_fold_kernel` in place), the same fold into
a copy when a checkpoint is exported (prefix-cache publish, prefill/decode hand-off) and the import, eager steps
with several prefill rows, verify windows of every width with a partial accept, a prefill chunk beside a decode
row, the MTP head's drafts. `warm_serving_steps` runs those on two requests of random token ids, then frees them:
their state slots and KV go back to the pools and the state's counters are cleared, so the metrics count serving
work only. The compile keys do not depend on the batch (rows, tokens, slots), so one launch per kernel variant is
enough.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

import torch

from lightllm.engine.batch import ForwardBatch
from lightllm.kernels.mla_attention import warmup_mla_attention
from lightllm.kernels.paged_attention import warmup_paged_attention
from lightllm.models.layers.moe import MoE
from lightllm.models.layers.quantized_linear import Fp8Weight, warmup_fp8_linears
from lightllm.worker.graphs.prefill import prefill_buckets


def start_pin_fla(device: str | torch.device) -> Future | None:
    """fla's import and pinning (`pin_fla`) started on a thread of its own, so that they run while the process loads
    weights and sizes its caches (and the compile-ahead workers compile); None off CUDA (nothing to pin)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    pending: Future = Future()

    def run() -> None:
        try:
            with torch.cuda.device(device):
                pending.set_result(_pin_for(device))
        except BaseException as exc:
            pending.set_exception(exc)

    threading.Thread(target=run, name="fla-import", daemon=True).start()
    return pending


def pin_fla(runner, pending: Future | None = None) -> None:
    """fla's chunk kernels pinned to the shipped table of this GPU kind (or a sibling's) instead of autotuning at
    their first call, before `warm_up` runs them (CUDA only; timed as a start-up phase). Importing fla takes
    seconds: `pending` (from `start_pin_fla`) is that work already under way, waited for here."""
    if runner.device.type != "cuda":
        return
    with runner.startup.phase("fla import and pinning"):
        if pending is not None:
            pending.result()
        else:
            _pin_for(runner.device)


def _pin_for(device: torch.device):
    from lightllm.linear_att.fla_pinning import pin_for_device

    return pin_for_device(torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device))


def warm_up(runner, max_num_tokens: int, progress: bool = True) -> int:
    """The runner's start-up warm-up, phase by phase (timed in its start-up log), after `pin_fla`: the decode
    kernels of a shape the shipped tables lack tuned, the linear-attention prefill kernels compiled at the serving
    shapes (the padded one-sequence prefills of the prefill graphs included), every attention kernel variant, the
    fused MoE and FP8 GEMM variants, then one step of each kind serving makes (`warm_serving_steps`). Returns the
    number of warm-up calls."""
    from lightllm.linear_att.startup_tune import tune_serving_shape
    from lightllm.linear_att.warmup import warmup_prefill

    phase, cuda = runner.startup.phase, runner.device.type == "cuda"
    with phase("decode tuning"):
        tune_serving_shape(runner.state, runner.linear_spec, progress=progress)
    graph_tokens = runner._prefill_graph_tokens()
    with phase("prefill warm-up"):
        calls = warmup_prefill(
            runner.state,
            runner.linear_spec,
            max_num_tokens=max_num_tokens,
            one_sequence_counts=prefill_buckets(graph_tokens),
            progress=progress,
        )
    with phase("attention warm-up"):
        calls += runner.warmup_attention()
    if cuda:
        with phase("expert and FP8 warm-up"):
            calls += warm_expert_and_fp8_kernels(runner.model, runner.dtype, max(max_num_tokens, graph_tokens))
        with phase("warm-up steps"):
            calls += warm_serving_steps(runner)
    return calls


# prompt chunks of the two warm-up requests: a first chunk from an empty state, then one resuming it
_CHUNKS = ((3, 5), (6, 2))


@torch.inference_mode()
def warm_serving_steps(runner, seed: int = 0) -> int:
    """Run one step of each kind serving makes on scratch requests of `runner` (a `ModelRunner` with a few dozen
    free KV tokens, before serving; two requests, or one when it has a single slot, which then never mixes a chunk
    with a decode row); returns the number of runner calls made."""
    gen = torch.Generator().manual_seed(seed)
    handles = [runner.add_request() for _ in range(min(2, runner.num_free_requests()))]
    calls = 0

    def step(prefill_lens: list[int], decode_width: int, decode_rows: list[int]) -> None:
        nonlocal calls
        rows = handles[: len(prefill_lens)] + decode_rows
        lens = list(prefill_lens) + [decode_width] * len(decode_rows)
        ids = torch.randint(1, runner.vocab_size, (sum(lens),), generator=gen)
        cached = [runner.num_tokens(h) for h in rows]
        runner.forward(ForwardBatch(rows, lens, cached, len(prefill_lens), ids, [False] * len(prefill_lens)))
        calls += 1
        if decode_rows:
            # a partial accept of the wider windows: the state's rollback path too
            runner.accept(decode_rows, [max(1, decode_width - 1)] * len(decode_rows))
            calls += 1

    for lens in _CHUNKS:
        step(list(lens[: len(handles)]), 0, [])
    for width in range(1, runner.max_width + 1):
        step([], width, handles)
    if runner.drafter is not None:
        runner.draft(handles, torch.randint(1, runner.vocab_size, (len(handles),), generator=gen), runner.mtp_step)
        calls += 1
    if len(handles) == 2:
        # a chunk beside a decode row; in replay mode the chunk's request folds the history its windows left
        step([4], 1, handles[1:])
    else:
        step([4], 0, [])
    runner.import_checkpoint(handles, runner.export_checkpoint(handles))
    calls += 2
    for handle in handles:
        runner.free_request(handle)
    for counter in runner.state.counters().values():
        counter.zero_()
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    return calls


def warm_attention_kernels(model: torch.nn.Module, dtype: torch.dtype, device) -> int:
    """Every tile size and split variant of the attention kernels `model`'s layers launch (the MTP head's
    included), on scratch tensors: paged attention at each `attention_kernel_shape`, MLA's latent kernel at each
    `latent_attention_shape`. Returns the launch count."""
    paged = {m.attention_kernel_shape() for m in model.modules() if hasattr(m, "attention_kernel_shape")}
    latent = {m.latent_attention_shape() for m in model.modules() if hasattr(m, "latent_attention_shape")}
    with torch.no_grad():
        launches = sum(warmup_paged_attention(*shape[:4], dtype, device, shape[4]) for shape in paged)
        launches += sum(warmup_mla_attention(*shape, dtype, device) for shape in latent)
    return launches


def warm_expert_and_fp8_kernels(model: torch.nn.Module, dtype: torch.dtype, max_tokens: int) -> int:
    """The fused MoE's kernels at every batch bucket of 1 .. `max_tokens` tokens (one layer per distinct expert
    shape: every other layer of that shape launches the same kernels) and each FP8 projection shape's GEMM, on
    scratch activations. Returns the launch count."""
    launches = warmup_fp8_linears(model, dtype)
    seen = set()
    for module in model.modules():
        if not isinstance(module, MoE):
            continue
        gate_up, down = module.gate_up, module.down
        if isinstance(gate_up, Fp8Weight):
            gate_up, down = gate_up.weight, down.weight
        key = (tuple(gate_up.shape), gate_up.dtype, tuple(down.shape))
        if key in seen:
            continue
        seen.add(key)
        launches += module.warmup_fused(max_tokens, dtype)
    return launches
