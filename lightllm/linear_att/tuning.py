"""The search that fills the launch-configuration tables (`autotune.py`): it times every candidate configuration
of each kernel family on disposable scratch state (fresh buffers it allocates; never serving state) and returns
the table entries. `startup_tune.py` runs it for a serving shape the shipped tables lack; the benchmark script's
`--tune` mode and `sweep_linear_att.py` write its entries to files.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from lightllm.linear_att.autotune import ConfigTable, KernelConfig, TuneKey, candidates, make_key
from lightllm.linear_att.bundles import CompactBuffers, NativeBuffers, ReplayBuffers, TokenInputs
from lightllm.linear_att.kernels.cursor import native_accept_triton, replay_accept_triton
from lightllm.linear_att.kernels.replay_fold import replay_fold_triton
from lightllm.linear_att.kernels.replay_verify import replay_verify_triton
from lightllm.linear_att.kernels.serial import compact_verify_triton, native_verify_triton
from lightllm.linear_att.registry import algorithm


@dataclass(frozen=True)
class TuneCase:
    """One shape to tune: the families "serial" (native), "compact", "replay" (per projection) and "replay_fold"."""

    algo: str
    H: int
    HV: int
    K: int
    V: int
    state_dtype: torch.dtype
    act_dtype: torch.dtype
    width: int
    replay_capacity: int
    lower_bound: float | None = None

    @property
    def GK(self) -> int:
        return algorithm(self.algo).gate_dim(self.K)


def served_cases(
    algorithm,
    head_dim: int = 128,
    *,
    state_dtypes=(torch.float32, torch.bfloat16),
    act_dtype=torch.bfloat16,
    widths=(1, 2, 4),
    replay_capacity: int = 16,
) -> list[TuneCase]:
    """The tuning cases of one algorithm's shipped table: every (key heads, value heads) it serves
    (`algorithm.served_heads`) x state dtype x verify width, at head dims `head_dim`."""
    return [
        TuneCase(algorithm.name, h, hv, head_dim, head_dim, dt, act_dtype, w, replay_capacity)
        for h, hv in algorithm.served_heads
        for dt in state_dtypes
        for w in widths
    ]


def _scratch_inputs(case: TuneCase, num_rows: int, device, gen):
    W, H, HV, K, V, GK = case.width, case.H, case.HV, case.K, case.V, case.GK

    def rnd(*size, dtype=torch.float32):
        return torch.randn(*size, generator=gen, device=device).to(dtype)

    tokens = TokenInputs(
        rnd(num_rows, W, H, K, dtype=case.act_dtype),
        rnd(num_rows, W, H, K, dtype=case.act_dtype),
        rnd(num_rows, W, HV, V, dtype=case.act_dtype),
        rnd(num_rows, W, HV, GK),
        rnd(num_rows, W, HV),
        rnd(HV) * 0.5,
        rnd(HV, GK) * 0.5,
        lower_bound=case.lower_bound,
    )
    slots = torch.arange(num_rows, device=device, dtype=torch.int32)
    widths = torch.full((num_rows,), W, device=device, dtype=torch.int32)
    return tokens, slots, widths


def _time_us(fn, device: torch.device) -> float:
    if device.type != "cuda":
        # the interpreter: one timed call (plumbing checks, not a measurement)
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    import triton.testing

    return 1e3 * float(triton.testing.do_bench(fn, warmup=5, rep=30, return_mode="median"))


def _time_configs(family: str, run, log, device: torch.device, configs=None) -> tuple[KernelConfig, dict[str, float]]:
    best, best_us = None, float("inf")
    for cfg in configs or candidates(family):
        try:
            us = _time_us(lambda cfg=cfg: run(cfg), device)
        except Exception as err:  # a config that does not compile or fit is skipped, not fatal
            log(f"  {family} {cfg}: skipped ({type(err).__name__}: {str(err)[:200]})")
            continue
        if us < best_us:
            best, best_us = cfg, us
    if best is None:
        raise RuntimeError(f"no {family} configuration ran")
    return best, {"us": best_us}


def tune(
    cases: list[TuneCase],
    *,
    num_rows: int = 256,
    device="cuda",
    log=print,
    configs: list[KernelConfig] | None = None,
    only: set[TuneKey] | None = None,
    on_done=None,
) -> tuple[ConfigTable, dict]:
    """Search the launch configurations of every family for `cases` on freshly allocated scratch buffers.

    Returns the table and per-entry timings (µs, median of `triton.testing.do_bench`). Serving state is never
    touched: every buffer here is allocated for the search and dropped afterwards. A timed step is what a serving
    step runs for the family: the verify and the accept after it (the fold alone for "replay_fold"). `configs`
    replaces the search space (tests); `only` limits the search to those keys; `on_done(key)` is called after each.
    """
    table, extra = ConfigTable(), {}
    for case in cases:
        for key, cfg, info in _tune_case(case, num_rows, torch.device(device), log, configs, only, on_done):
            table.put(key, cfg)
            extra[key.to_str()] = info
    return table, extra


def case_keys(case: TuneCase, device) -> list[TuneKey]:
    """The keys `tune` fills for `case`, in its order: serial, compact, replay inline, replay precompute, replay
    fold."""
    shape = (case.state_dtype, case.act_dtype, case.H, case.HV, case.K, case.V, case.GK)
    W, L, lb = case.width, case.replay_capacity, case.lower_bound
    return [
        make_key("serial", device, *shape, W, lower_bound=lb),
        make_key("compact", device, *shape, W, lower_bound=lb),
        make_key("replay", device, *shape, W, L, "inline", lb),
        make_key("replay", device, *shape, W, L, "precompute", lb),
        make_key("replay_fold", device, case.state_dtype, torch.float32, *shape[2:], 0, L),
    ]


def _tune_case(case: TuneCase, num_rows: int, device: torch.device, log, configs, only=None, on_done=None):
    gen = torch.Generator(device=device).manual_seed(0)
    tokens, slots, widths = _scratch_inputs(case, num_rows, device, gen)
    W, H, HV, K, V, GK, L = case.width, case.H, case.HV, case.K, case.V, case.GK, case.replay_capacity
    serial_key, compact_key, inline_key, precompute_key, fold_key = case_keys(case, device)
    offset = torch.zeros(num_rows, device=device, dtype=torch.int32)

    native = NativeBuffers(
        torch.zeros(num_rows, W, HV, K, V, device=device, dtype=case.state_dtype),
        torch.zeros(num_rows, device=device, dtype=torch.int32),
    )

    def serial_step(cfg):
        native_verify_triton(tokens, native, slots, widths, config=cfg)
        native_accept_triton(native.ssm_index, offset, slots, widths, widths)

    # every slot merges W - 1 pending records per verify (a round that accepted all but the bonus token); compact's
    # accept launches nothing, so the verify is the whole step
    compact = CompactBuffers(
        torch.zeros(num_rows, HV, K, V, device=device, dtype=case.state_dtype),
        torch.randn(num_rows, 2, W, H, K, device=device, generator=gen) * 0.1,
        torch.randn(num_rows, 2, W, HV, V, device=device, generator=gen) * 0.1,
        -torch.rand(num_rows, 2, W, HV, GK, device=device, generator=gen),
        torch.full((num_rows,), max(1, W - 1), device=device, dtype=torch.int32),
        torch.zeros(num_rows, device=device, dtype=torch.int32),
    )

    def compact_step(cfg):
        compact_verify_triton(tokens, compact, slots, widths, config=cfg)

    # cursors spread over the whole cycle and advanced by every accept, so the timed mix holds the amortised share
    # of folding rows
    replay = ReplayBuffers(
        torch.zeros(num_rows, HV, K, V, device=device, dtype=case.state_dtype),
        torch.randn(num_rows, 2, L, H, K, device=device, generator=gen) * 0.1,
        torch.randn(num_rows, 2, L, HV, V, device=device, generator=gen) * 0.1,
        -torch.rand(num_rows, 2, L, HV, GK, device=device, generator=gen).cumsum(2),
        torch.randint(0, L + 1, (num_rows,), device=device, dtype=torch.int32, generator=gen),
        torch.zeros(num_rows, device=device, dtype=torch.int32),
    )

    def replay_step(cfg, projection):
        replay_verify_triton(tokens, replay, slots, widths, projection=projection, config=cfg)
        replay_accept_triton(replay.cursor, replay.parity, offset, slots, widths, widths, L)

    full = torch.full_like(replay.cursor, L)
    stacked = ReplayBuffers(*(t[None] for t in replay.pointers[:4]), full, replay.parity)
    jobs = [
        (serial_key, "serial", serial_step),
        *([(compact_key, "compact", compact_step)] if W > 1 else []),  # compact mode verifies windows of 2 or more
        (inline_key, "replay", lambda cfg: replay_step(cfg, "inline")),
        (precompute_key, "replay", lambda cfg: replay_step(cfg, "precompute")),
        (fold_key, "replay_fold", lambda cfg: replay_fold_triton(stacked, slots, config=cfg)),
    ]
    results = []
    for key, family, step in jobs:
        if only is not None and key not in only:
            continue
        log(f"tuning {key.to_str()}")
        best, info = _time_configs(family, step, log, device, configs)
        results.append((key, best, info))
        if on_done is not None:
            on_done(key)
    return results
