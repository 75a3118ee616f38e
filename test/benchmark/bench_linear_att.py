"""Decode / verify kernels of the linear-attention state modes against fla-core and the HBM floors, one run.

    python test/benchmark/bench_linear_att.py            # full table (H200: a few minutes incl. compile)
    python test/benchmark/bench_linear_att.py --quick    # a subset
    python test/benchmark/bench_linear_att.py --tune tuned.json [--quick]   # autotune, write the table, exit
    python test/benchmark/bench_linear_att.py --tables tuned.json           # benchmark with tuned configs

First a short correctness pass (Triton vs the torch twins at each shape), then timings: every step is captured in
a CUDA graph over state pools rotated beyond L2, one step per pool per replay, and the per-slot scalars advance
inside the graph (native index, replay cursor / parity), so replay runs through its full fold cycles and the time
is the amortised cost of one step; compact is its one verify launch, merging W - 1 pending tokens every step. fla-core's `fused_recurrent_gated_delta_rule` (GDN) and
`fused_recurrent_kda_fwd` with an in-place pool (KDA) run side by side, and the read+write / read-only floors
come from a device-to-device copy timed in the same run. Failures are printed per cell; the table always
finishes. `--device cpu` runs a tiny smoke version under the Triton interpreter (no graphs).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass

# the CPU smoke run needs Triton's interpreter, which is chosen when the kernels are defined (at import)
if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1 :][:1] == ["cpu"]:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from lightllm.linear_att.bundles import CompactBuffers, NativeBuffers, ReplayBuffers, TokenInputs  # noqa: E402
from lightllm.tools.gpu_timing import copy_bandwidth  # noqa: E402

L2_BYTES = 60 << 20


@dataclass(frozen=True)
class Shape:
    name: str
    algo: str
    H: int
    HV: int
    K: int
    V: int

    @property
    def GK(self) -> int:
        return 1 if self.algo == "gdn" else self.K


SHAPES = {
    "qwen3-next-tp1": Shape("qwen3-next-tp1", "gdn", 16, 32, 128, 128),
    "qwen3.5-tp1": Shape("qwen3.5-tp1", "gdn", 16, 64, 128, 128),
    "kimi-linear-tp1": Shape("kimi-linear-tp1", "kda", 32, 32, 128, 128),
}
TINY = {"tiny-gdn": Shape("tiny-gdn", "gdn", 1, 2, 16, 16), "tiny-kda": Shape("tiny-kda", "kda", 1, 1, 16, 16)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MODES = ("fla", "native", "compact", "replay-i", "replay-p")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="N in {1, 64, 128, 256}, W in {1, 4}, fp32 state only")
    p.add_argument("--tune", metavar="PATH", help="run the autotuner for the selected shapes, write JSON, exit")
    p.add_argument("--tables", nargs="*", default=[], help="extra tuned tables to load before benchmarking")
    p.add_argument("--shapes", default="qwen3-next-tp1,qwen3.5-tp1,kimi-linear-tp1")
    p.add_argument("--state-dtypes", default="fp32,bf16")
    p.add_argument("--ns", default="1,8,32,64,128,256,512")
    p.add_argument("--ws", default="1,2,4")
    p.add_argument("--replay_capacity", type=int, default=16, help="replay history replay_capacity L")
    p.add_argument("--act-dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--budget-s", type=float, default=420.0, help="skip the remaining cells after this many seconds")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = p.parse_args(argv)
    if args.quick:
        args.ns, args.ws, args.state_dtypes = "1,64,128,256", "1,4", "fp32"
    if args.device == "cpu":
        args.shapes, args.ns, args.ws, args.state_dtypes, args.act_dtype = (
            "tiny-gdn,tiny-kda",
            "2",
            "1,2",
            "fp32",
            "fp32",
        )
        args.replay_capacity = min(args.replay_capacity, 4)
    return args


# ----------------------------------------------------------------------------------------------------------- timing
class Timer:
    """Per-step µs of a list of step callables (one per rotated pool): CUDA graph replays on the GPU."""

    def __init__(self, device: torch.device, reps: int):
        self.device, self.reps = device, reps

    def __call__(self, steps) -> float:
        if self.device.type != "cuda":
            t0 = time.perf_counter()
            for fn in steps:
                fn()
            return (time.perf_counter() - t0) / len(steps) * 1e6
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for fn in steps:  # compile + warm up outside the capture
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for fn in steps:
                fn()
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(self.reps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        us = start.elapsed_time(end) * 1e3 / (self.reps * len(steps))
        del graph
        return us


# ----------------------------------------------------------------------------------------------------------- inputs
@dataclass
class Inputs:
    args: tuple  # q, k, v, graw, braw, A_log, dt_bias
    slots: torch.Tensor
    widths: torch.Tensor
    accepted: torch.Tensor

    @property
    def tokens(self) -> TokenInputs:
        return TokenInputs(*self.args)


def make_inputs(shape: Shape, N: int, W: int, act_dtype, device, seed=0) -> Inputs:
    gen = torch.Generator(device=device).manual_seed(seed)

    def rnd(*size, dtype=torch.float32, s=1.0):
        return (torch.randn(*size, generator=gen, device=device) * s).to(dtype)

    args = (
        rnd(N, W, shape.H, shape.K, dtype=act_dtype),
        rnd(N, W, shape.H, shape.K, dtype=act_dtype),
        rnd(N, W, shape.HV, shape.V, dtype=act_dtype),
        rnd(N, W, shape.HV, shape.GK),
        rnd(N, W, shape.HV),
        rnd(shape.HV, s=0.5),
        rnd(shape.HV, shape.GK, s=0.5),
    )
    slots = torch.arange(N, device=device, dtype=torch.int32)
    widths = torch.full((N,), W, device=device, dtype=torch.int32)
    accepted = torch.randint(1, W + 1, (N,), generator=gen, device=device, dtype=torch.int32)
    return Inputs(args, slots, widths, accepted)


def num_pools(bytes_per_pool: int, device) -> int:
    if device.type != "cuda":
        return 1
    return max(1, min(128, math.ceil(4 * L2_BYTES / max(1, bytes_per_pool))))


# ----------------------------------------------------------------------------------------------------------- steps
def native_steps(shape, inp, N, W, state_dtype, device, config=None):
    from lightllm.linear_att.kernels.cursor import native_accept_triton
    from lightllm.linear_att.kernels.serial import native_verify_triton

    per_pool = N * W * shape.HV * shape.K * shape.V * state_dtype.itemsize
    steps, tokens = [], inp.tokens
    for _ in range(num_pools(per_pool, device)):
        ssm = torch.randn(N, W, shape.HV, shape.K, shape.V, device=device).mul_(0.05).to(state_dtype)
        state = NativeBuffers(ssm, torch.zeros(N, device=device, dtype=torch.int32))
        offset = torch.zeros_like(state.ssm_index)

        def step(state=state, offset=offset):
            native_verify_triton(tokens, state, inp.slots, inp.widths, config=config)
            native_accept_triton(state.ssm_index, offset, inp.slots, inp.widths, inp.accepted)

        steps.append(step)
    return steps


def compact_buffers(shape, N, W, state_dtype, act_dtype, device):
    """State, two record buffers per slot (k̂, u, g: fp32), and every slot with W - 1 tokens pending (a typical
    round's merge)."""
    ssm = torch.randn(1, N, shape.HV, shape.K, shape.V, device=device).mul_(0.05).to(state_dtype)
    win = (
        torch.zeros(1, N, 2, W, shape.H, shape.K, device=device),
        torch.zeros(1, N, 2, W, shape.HV, shape.V, device=device),
        torch.zeros(1, N, 2, W, shape.HV, shape.GK, device=device),
    )
    pending = torch.full((N,), max(1, W - 1), dtype=torch.int32, device=device)
    parity = torch.zeros(N, dtype=torch.int32, device=device)
    return ssm, win, pending, parity


def compact_steps(shape, inp, N, W, state_dtype, device, config=None):
    """One compact step is one verify launch (it merges the previous window's pending tokens); accept runs no
    kernel, so pending / parity stay fixed here and every step merges W - 1 tokens from buffer 0."""
    from lightllm.linear_att.kernels.serial import compact_verify_triton

    act_dtype = inp.args[0].dtype
    per_pool = N * shape.HV * shape.K * shape.V * state_dtype.itemsize
    steps, tokens = [], inp.tokens
    for _ in range(num_pools(per_pool, device)):
        ssm, win, pending, parity = compact_buffers(shape, N, W, state_dtype, act_dtype, device)
        state = CompactBuffers(ssm[0], *(t[0] for t in win), pending, parity)

        def step(state=state):
            compact_verify_triton(tokens, state, inp.slots, inp.widths, config=config)

        steps.append(step)
    return steps


def replay_buffers(shape, N, L, state_dtype, device, seed=1):
    gen = torch.Generator(device=device).manual_seed(seed)
    ssm = torch.randn(N, shape.HV, shape.K, shape.V, device=device, generator=gen).mul_(0.05).to(state_dtype)
    hist = (
        torch.nn.functional.normalize(torch.randn(N, 2, L, shape.H, shape.K, device=device, generator=gen), dim=-1),
        torch.randn(N, 2, L, shape.HV, shape.V, device=device, generator=gen) * 0.1,
        -(torch.rand(N, 2, L, shape.HV, shape.GK, device=device, generator=gen) * 0.1).cumsum(2),
    )
    # rows start at spread-out phases of the fold cycle
    cursor = torch.randint(0, L + 1, (N,), device=device, dtype=torch.int32, generator=gen)
    parity = torch.zeros(N, device=device, dtype=torch.int32)
    return ssm, hist, cursor, parity


def replay_steps(shape, inp, N, W, L, state_dtype, projection, device, config=None):
    from lightllm.linear_att.kernels.cursor import replay_accept_triton
    from lightllm.linear_att.kernels.replay_verify import replay_verify_triton

    per_pool = N * shape.HV * shape.K * shape.V * state_dtype.itemsize
    steps, tokens = [], inp.tokens
    for r in range(num_pools(per_pool, device)):
        ssm, hist, cursor, parity = replay_buffers(shape, N, L, state_dtype, device, seed=r + 1)
        state = ReplayBuffers(ssm, *hist, cursor, parity)
        offset = torch.zeros_like(cursor)

        def step(state=state, offset=offset):
            replay_verify_triton(tokens, state, inp.slots, inp.widths, projection=projection, config=config)
            replay_accept_triton(state.cursor, state.parity, offset, inp.slots, inp.widths, inp.accepted, L)

        steps.append(step)
    return steps


def fla_steps(shape, inp, N, W, state_dtype, device):
    q, k, v, graw, braw, A_log, dt_bias = inp.args
    per_pool = N * W * shape.HV * shape.K * shape.V * state_dtype.itemsize
    pools = num_pools(per_pool, device)
    steps = []
    if shape.algo == "gdn":
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

        g = -torch.nn.functional.softplus(graw[..., 0] + dt_bias[:, 0]) * A_log.exp()
        beta = torch.sigmoid(braw)
        for _ in range(pools):
            h0 = torch.randn(N, shape.HV, shape.K, shape.V, device=device).mul_(0.05).to(state_dtype)

            def step(h0=h0):
                fused_recurrent_gated_delta_rule(
                    q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True
                )

            steps.append(step)
        return steps
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    out = torch.empty_like(v)
    for _ in range(pools):
        # the serving pool layout: W state slots per row, the state after token t written to slot t
        pool = torch.randn(N * W, shape.HV, shape.K, shape.V, device=device).mul_(0.05).to(state_dtype)
        index = torch.arange(N * W, device=device, dtype=torch.int32).view(N, W)
        index = index[:, 0].contiguous() if W == 1 else index
        num_acc = torch.ones(N, device=device, dtype=torch.int32) if W > 1 else None

        def step(pool=pool, index=index, num_acc=num_acc):
            fused_recurrent_kda_fwd(
                q,
                k,
                v,
                graw,
                braw,
                A_log=A_log,
                dt_bias=dt_bias.reshape(-1),
                initial_state=pool,
                inplace_final_state=True,
                ssm_state_indices=index,
                num_accepted_tokens=num_acc,
                use_qk_l2norm_in_kernel=True,
                use_gate_in_kernel=True,
                use_beta_sigmoid_in_kernel=True,
                out=out,
            )

        steps.append(step)
    return steps


# ----------------------------------------------------------------------------------------------------------- check
def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def correctness(shape: Shape, state_dtype, act_dtype, L, device) -> list[str]:
    """Triton vs torch twins at N=5 rows (one padding), W=4, every op; returns printable lines."""
    from lightllm.linear_att.kernels.replay_fold import replay_fold_triton
    from lightllm.linear_att.kernels.replay_verify import replay_verify_triton
    from lightllm.linear_att.kernels.serial import compact_commit_triton, compact_verify_triton, native_verify_triton
    from lightllm.linear_att.torch_ops import replay as replay_twin
    from lightllm.linear_att.torch_ops import verify as verify_twin

    N, W = 5, min(4, L)
    inp = make_inputs(shape, N, W, act_dtype, device, seed=3)
    inp.widths[1] = 0
    inp.accepted.clamp_(max=inp.widths.clamp(min=1))
    tol = 2e-2 if act_dtype == torch.bfloat16 or state_dtype == torch.bfloat16 else 2e-3
    lines = []

    def report(name, err):
        lines.append(f"  {shape.name} {name:<22} rel err {err:.2e} {'ok' if err <= tol else 'FAIL'}")

    ssm = torch.randn(N, W, shape.HV, shape.K, shape.V, device=device).mul_(0.1).to(state_dtype)
    index = torch.zeros(N, device=device, dtype=torch.int32)
    ssm_t = ssm.clone()
    tokens = inp.tokens
    o = native_verify_triton(tokens, NativeBuffers(ssm, index), inp.slots, inp.widths)
    o_t = verify_twin.native_verify(tokens, NativeBuffers(ssm_t, index), inp.slots, inp.widths)
    report("native o", rel(o, o_t))
    report("native states", rel(ssm.float(), ssm_t.float()))

    base, win, pending, parity = compact_buffers(shape, N, W, state_dtype, act_dtype, device)
    pending.zero_()
    base_t, win_t = base.clone(), tuple(t.clone() for t in win)
    o_c = compact_verify_triton(
        tokens, CompactBuffers(base[0], *(t[0] for t in win), pending, parity), inp.slots, inp.widths
    )
    o_ct = verify_twin.compact_verify(
        tokens, CompactBuffers(base_t[0], *(t[0] for t in win_t), pending, parity), inp.slots, inp.widths
    )
    # accept: the window just written (buffer 1) holds the accepted tokens; commit merges them
    pending[inp.slots.long()] = torch.where(inp.widths > 0, inp.accepted, 0)
    parity.fill_(1)
    compact_commit_triton(CompactBuffers(base, *win, pending, parity), inp.slots)
    verify_twin.compact_commit(CompactBuffers(base_t, *win_t, pending, parity), inp.slots)
    report("compact o", rel(o_c, o_ct))
    report("compact state", rel(base.float(), base_t.float()))

    for projection in ("inline", "precompute"):
        ssm_r, hist, cursor, parity = replay_buffers(shape, N, L, state_dtype, device)
        cursor[0] = L  # row 0 folds inside the verify
        ssm_rt, hist_t = ssm_r.clone(), tuple(t.clone() for t in hist)
        o_r = replay_verify_triton(
            tokens, ReplayBuffers(ssm_r, *hist, cursor, parity), inp.slots, inp.widths, projection=projection
        )
        o_rt = replay_twin.replay_verify(tokens, ReplayBuffers(ssm_rt, *hist_t, cursor, parity), inp.slots, inp.widths)
        report(f"replay-{projection[0]} o", rel(o_r, o_rt))
        report(f"replay-{projection[0]} state", rel(ssm_r.float(), ssm_rt.float()))
    ssm_f, hist_f, cursor_f, parity_f = replay_buffers(shape, N, L, state_dtype, device, seed=5)
    out = torch.empty(1, N, shape.HV, shape.K, shape.V, device=device, dtype=state_dtype)
    out_t = torch.empty_like(out)
    stacked = ReplayBuffers(ssm_f[None], *(t[None] for t in hist_f), cursor_f, parity_f)
    replay_fold_triton(stacked, inp.slots, out=out)
    replay_twin.replay_fold(stacked, inp.slots, out=out_t)
    report("replay fold", rel(out.float(), out_t.float()))
    return lines


# ----------------------------------------------------------------------------------------------------------- main
def fmt(us) -> str:
    if isinstance(us, str):
        return us
    return f"{us:.1f}" if us >= 10 else f"{us:.2f}"


def ratio(a, b) -> str:
    if isinstance(a, str) or isinstance(b, str) or not b or math.isnan(a) or math.isnan(b):
        return "-"
    return f"{a / b:.2f}"


def run_tune(args, shapes, state_dtypes, act_dtype, device) -> None:
    """Tune case by case, saving after each one, so a run cut short still leaves a usable table."""
    from lightllm.linear_att import autotune, tuning

    cases = [
        tuning.TuneCase(shape.algo, shape.H, shape.HV, shape.K, shape.V, dt, act_dtype, W, args.replay_capacity)
        for shape in shapes
        for dt in state_dtypes
        for W in [int(w) for w in args.ws.split(",")]
    ]
    t0 = time.time()
    table, extra = autotune.ConfigTable(), {}
    for i, case in enumerate(cases):
        if time.time() - t0 > args.budget_s:
            print(f"time budget reached: {len(cases) - i} cases left untuned")
            break
        part, info = tuning.tune([case], num_rows=256 if device.type == "cuda" else 2, device=device)
        table.update(part)
        extra.update(info)
        table.save(args.tune, extra)
        print(f"[{time.time() - t0:.0f} s] case {i + 1}/{len(cases)} done: {case}", flush=True)
    print(f"wrote {len(table.entries)} tuned entries to {args.tune} in {time.time() - t0:.0f} s")
    for key, cfg in sorted(table.entries.items()):
        print(f"  {key}: {cfg} ({extra[key]['us']:.1f} us)")


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --device cpu for the interpreter smoke run")
        return 1
    from lightllm.linear_att.registry import ALGORITHMS

    # a table file may hold either algorithm's entries: the gate width in every key keeps them apart
    for algorithm in ALGORITHMS.values():
        algorithm.add_tables(args.tables)
    shapes = [(SHAPES | TINY)[s] for s in args.shapes.split(",")]
    state_dtypes = [DTYPES[s] for s in args.state_dtypes.split(",")]
    act_dtype = DTYPES[args.act_dtype]
    if args.tune:
        run_tune(args, shapes, state_dtypes, act_dtype, device)
        return 0

    import triton

    t_start = time.time()
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    print(
        f"# bench_linear_att: {gpu}, torch {torch.__version__}, triton {triton.__version__}, "
        f"act {args.act_dtype}, replay replay_capacity {args.replay_capacity}"
    )
    try:
        import fla

        print(f"fla-core {getattr(fla, '__version__', '?')}")
    except Exception as err:
        print(f"fla-core unavailable ({type(err).__name__}): anchor columns will show errors")

    print("\n## correctness (Triton vs torch twins, N=5 incl. one padding row, W=4)")
    for shape in shapes:
        try:
            for line in correctness(shape, state_dtypes[0], act_dtype, args.replay_capacity, device):
                print(line)
        except Exception as err:
            print(f"  {shape.name}: correctness pass raised {type(err).__name__}: {err}")

    bw = copy_bandwidth(device)
    print(f"\ndevice copy: {bw / 1e12:.2f} TB/s (read + write bytes)")
    timer = Timer(device, reps=max(24, 2 * args.replay_capacity))
    Ns = [int(n) for n in args.ns.split(",")]
    Ws = [int(w) for w in args.ws.split(",")]
    for shape in shapes:
        for state_name, state_dtype in ((n, DTYPES[n]) for n in args.state_dtypes.split(",")):
            print(
                f"\n## {shape.name} ({shape.algo}, H={shape.H} HV={shape.HV} K={shape.K} V={shape.V}), "
                f"{state_name} state, µs per step (amortised over fold cycles)"
            )
            print(
                "| W | N | fla | native | compact | replay-i | replay-p | rw floor | read floor "
                "| native/rw floor | fla/replay | native/replay | native/compact |"
            )
            print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
            for W in Ws:
                if W > args.replay_capacity:
                    continue
                for N in Ns:
                    row = bench_cell(shape, state_dtype, act_dtype, N, W, args, device, timer, t_start)
                    state_bytes = N * shape.HV * shape.K * shape.V * state_dtype.itemsize
                    rw, rd = 2 * state_bytes / bw * 1e6, state_bytes / bw * 1e6
                    best_replay = min(
                        (row[m] for m in ("replay-i", "replay-p") if not isinstance(row[m], str)), default="-"
                    )
                    print(
                        f"| {W} | {N} | " + " | ".join(fmt(row[m]) for m in MODES) + f" | {fmt(rw)} | {fmt(rd)} | "
                        f"{ratio(rw, row['native']) if W == 1 else '-'} | {ratio(row['fla'], best_replay)} | "
                        f"{ratio(row['native'], best_replay)} | {ratio(row['native'], row['compact'])} |",
                        flush=True,
                    )
    print(
        f"\ntotal {time.time() - t_start:.0f} s. native/rw floor: fraction of the read+write floor reached "
        "(W = 1); ratios > 1 mean the second column is faster."
    )
    return 0


def bench_cell(shape, state_dtype, act_dtype, N, W, args, device, timer, t_start) -> dict:
    row = {}
    inp = make_inputs(shape, N, W, act_dtype, device)
    builders = {
        "fla": lambda: fla_steps(shape, inp, N, W, state_dtype, device),
        "native": lambda: native_steps(shape, inp, N, W, state_dtype, device),
        "compact": lambda: compact_steps(shape, inp, N, W, state_dtype, device),
        "replay-i": lambda: replay_steps(shape, inp, N, W, args.replay_capacity, state_dtype, "inline", device),
        "replay-p": lambda: replay_steps(shape, inp, N, W, args.replay_capacity, state_dtype, "precompute", device),
    }
    for mode in MODES:
        if time.time() - t_start > args.budget_s:
            row[mode] = "skip(time)"
            continue
        if mode == "compact" and W == 1:
            row[mode] = "-"  # compact needs speculative windows; plain decode is native
            continue
        try:
            steps = builders[mode]()
            row[mode] = timer(steps)
        except Exception as err:
            print(f"<!-- {shape.name} {mode} N={N} W={W}: {type(err).__name__}: {str(err)[:200]} -->", flush=True)
            row[mode] = "err"
        finally:
            steps = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return row


if __name__ == "__main__":
    raise SystemExit(main())
