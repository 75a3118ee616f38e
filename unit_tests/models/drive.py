"""Drive a ModelRunner the way the engine does (prefill chunks, decode and verify rows, accept)."""

from __future__ import annotations

import torch

from lightllm.engine.batch import ForwardBatch
from lightllm.worker.config import RunnerConfig
from lightllm.worker.runner import ModelRunner


def make_runner(model_dir: str, mode: str = "native", mtp_step: int = 0, max_width: int = 0, **kw) -> ModelRunner:
    cfg = RunnerConfig(
        model_dir=model_dir,
        device="cpu",
        data_type="float32",
        ssm_state_mode=mode,
        linear_att_ssm_data_type="float32",
        mtp_step=mtp_step,
        max_width=max_width,
        max_running_requests=kw.pop("max_running_requests", 4),
        max_total_token_num=kw.pop("max_total_token_num", 1024),
        max_req_total_len=kw.pop("max_req_total_len", 512),
        **kw,
    )
    return ModelRunner(cfg)


def prefill(runner: ModelRunner, handle: int, ids: list[int], chunk: int | None = None) -> torch.Tensor:
    """Prefill `ids` in chunks of `chunk` tokens; returns the logits of the last position [V]."""
    chunk = chunk or len(ids)
    start = runner.num_tokens(handle)
    out = None
    for s in range(0, len(ids), chunk):
        part = ids[s : s + chunk]
        last = s + chunk >= len(ids)
        batch = ForwardBatch([handle], [len(part)], [start + s], 1, torch.tensor(part), [last])
        out = runner.forward(batch)
    return out.logits[-1]


def verify(runner: ModelRunner, handle: int, window: list[int]) -> torch.Tensor:
    """One decode/verify row; returns logits [W, V] (the caller must `accept`)."""
    batch = ForwardBatch([handle], [len(window)], [runner.num_tokens(handle)], 0, torch.tensor(window))
    return runner.forward(batch).logits


def decode(runner: ModelRunner, handle: int, token: int) -> torch.Tensor:
    logits = verify(runner, handle, [token])[0]
    runner.accept([handle], [1])
    return logits
