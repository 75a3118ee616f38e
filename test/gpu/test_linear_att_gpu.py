"""GPU suite of the linear-attention Triton kernels at real shapes (skipped without CUDA).

bf16 activations, fp32 and bf16 state; Qwen3-Next TP1 (GDN, H=16, HV=32, K=V=128) and Kimi-Linear TP1 (KDA,
H=HV=32): Triton vs the torch twins, native == compact bitwise, CUDA-graph replay == eager across fold cycles,
and a race check (many V tiles, grouped heads, folds every step) against a one-tile launch.
"""

from __future__ import annotations

import pytest
import torch

from lightllm.linear_att.autotune import KernelConfig
from lightllm.linear_att.bundles import CompactBuffers, NativeBuffers, ReplayBuffers, TokenInputs
from unit_tests.helpers.asserts import assert_rel_close

pytestmark = pytest.mark.gpu

QWEN3_NEXT = ("gdn", 16, 32, 128, 128)
KIMI = ("kda", 32, 32, 128, 128)
SHAPES = [pytest.param(QWEN3_NEXT, id="qwen3-next"), pytest.param(KIMI, id="kimi-linear")]
STATE = [pytest.param(torch.float32, id="fp32-state"), pytest.param(torch.bfloat16, id="bf16-state")]


def _inputs(shape, N, W, gen, act_dtype=torch.bfloat16):
    algo, H, HV, K, V = shape
    GK = 1 if algo == "gdn" else K

    def rnd(*size, s=1.0):
        return torch.randn(*size, generator=gen, device="cuda") * s

    args = (
        rnd(N, W, H, K).to(act_dtype),
        rnd(N, W, H, K).to(act_dtype),
        rnd(N, W, HV, V).to(act_dtype),
        rnd(N, W, HV, GK),
        rnd(N, W, HV),
        torch.rand(HV, generator=gen, device="cuda") * 1.5 - 1.0,
        rnd(HV, GK, s=0.5),
    )
    return args


def _rows(N, W, gen, num_slots):
    slots = torch.randperm(num_slots - 1, generator=gen, device="cuda")[:N].to(torch.int32)
    widths = torch.randint(1, W + 1, (N,), generator=gen, device="cuda", dtype=torch.int32)
    widths[::7] = W
    widths[3::11] = 0  # padding rows (on a real slot: must stay untouched)
    accepted = torch.minimum(torch.randint(1, W + 1, (N,), generator=gen, device="cuda", dtype=torch.int32), widths)
    return slots, widths, accepted.clamp(min=1)


class Replay:
    def __init__(self, shape, num_slots, L, state_dtype, gen):
        algo, H, HV, K, V = shape
        GK = 1 if algo == "gdn" else K
        self.ssm = (torch.randn(num_slots, HV, K, V, generator=gen, device="cuda") * 0.05).to(state_dtype)
        self.hist = [
            torch.full((num_slots, 2, L, H, K), float("nan"), device="cuda"),
            torch.full((num_slots, 2, L, HV, V), float("nan"), device="cuda"),
            torch.full((num_slots, 2, L, HV, GK), float("nan"), device="cuda"),
        ]
        self.cursor = torch.zeros(num_slots, dtype=torch.int32, device="cuda")
        self.parity = torch.zeros_like(self.cursor)
        self.offset = torch.zeros_like(self.cursor)
        self.L = L

    def clone(self):
        other = object.__new__(Replay)
        other.__dict__ = {
            k: (v.clone() if torch.is_tensor(v) else [t.clone() for t in v] if isinstance(v, list) else v)
            for k, v in self.__dict__.items()
        }
        return other

    def poison_dead(self):
        num_slots, _, L = self.hist[0].shape[:3]
        pos = torch.arange(L, device="cuda")
        for t in self.hist:
            dead_live = (pos[None, :] >= self.cursor[:, None].long()).view(num_slots, L, *([1] * (t.dim() - 3)))
            live = t[torch.arange(num_slots, device="cuda"), self.parity.long()]
            live.masked_fill_(dead_live, float("nan"))
            t[torch.arange(num_slots, device="cuda"), self.parity.long()] = live
            t[torch.arange(num_slots, device="cuda"), 1 - self.parity.long()] = float("nan")


def _replay_step(rep, args, slots, widths, accepted, projection, lower_bound=None, config=None, backend="triton"):
    from lightllm.linear_att import ops
    from lightllm.linear_att.kernels.replay_verify import replay_verify_triton

    tokens = TokenInputs(*args, lower_bound=lower_bound)
    state = ReplayBuffers(rep.ssm, *rep.hist, rep.cursor, rep.parity)
    if backend == "triton" and config is not None:
        o = replay_verify_triton(tokens, state, slots, widths, projection=projection, config=config)
    else:
        o = ops.replay_verify(tokens, state, slots, widths, projection=projection, backend=backend)
    ops.replay_accept(rep.cursor, rep.parity, rep.offset, slots, widths, accepted, rep.L, backend=backend)
    return o


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("state_dtype", STATE)
def test_native_and_compact_match_twin_and_each_other(shape, state_dtype):
    from lightllm.linear_att import ops
    from lightllm.linear_att.kernels.launch import serial_config

    gen = torch.Generator(device="cuda").manual_seed(0)
    _, H, HV, K, V = shape
    N, W, num_slots = 96, 4, 128
    args = _inputs(shape, N, W, gen)
    slots, widths, accepted = _rows(N, W, gen, num_slots)
    base = (torch.randn(num_slots, HV, K, V, generator=gen, device="cuda") * 0.05).to(state_dtype)
    native = torch.zeros(num_slots, W, HV, K, V, device="cuda", dtype=state_dtype)
    native[:, 0] = base
    index = torch.zeros(num_slots, dtype=torch.int32, device="cuda")
    native_t = native.clone()
    tokens = TokenInputs(*args)
    # native's tuned tiling for both modes: compact is native bitwise under the same tiling (its own tuned family
    # may pick another)
    cfg = serial_config(None, None, state_dtype, args[2].dtype, H, HV, K, V, args[3].shape[-1], W, "cuda")
    o = ops.native_verify(tokens, NativeBuffers(native, index), slots, widths, config=cfg, backend="triton")
    o_t = ops.native_verify(tokens, NativeBuffers(native_t, index), slots, widths, backend="torch")
    tol = 2e-2
    assert_rel_close("native o", o, o_t, tol)
    assert_rel_close("native states", native.float(), native_t.float(), tol)

    GK = args[3].shape[-1]
    ssm = base.clone()[None]
    win = [
        torch.zeros(1, num_slots, 2, W, H, K, device="cuda"),
        torch.zeros(1, num_slots, 2, W, HV, V, device="cuda"),
        torch.zeros(1, num_slots, 2, W, HV, GK, device="cuda"),
    ]
    pending = torch.zeros(num_slots, dtype=torch.int32, device="cuda")
    parity = torch.zeros(num_slots, dtype=torch.int32, device="cuda")
    layer = CompactBuffers(ssm[0], *(t[0] for t in win), pending, parity)
    o_c = ops.compact_verify(tokens, layer, slots, widths, config=cfg, backend="triton")
    assert torch.equal(o_c, o), "compact verify outputs != native outputs (bitwise)"
    assert torch.equal(ssm[0], base), "compact verify with nothing pending wrote the state"
    # what CompactState.accept does: the window just written (buffer 1) holds the pending tokens
    live = widths > 0
    pending[slots[live].long()] = accepted[live]
    parity[slots[live].long()] = 1
    ops.compact_commit(CompactBuffers(ssm, *win, pending, parity), slots, backend="triton")
    expect = base.clone()
    expect[slots[live].long()] = native[slots[live].long(), (accepted[live] - 1).long()]
    assert torch.equal(ssm[0], expect), "compact commit != native state at the accepted token (bitwise)"


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("N", [1, 2, 3])
def test_small_batches_match_the_twins_under_the_looked_up_tile(shape, N):
    """A batch of a few rows launches the looked-up tile narrowed for it (`launch.filled_block_v`: one row of 32
    heads gets 32-wide V tiles on an H200): native and compact verify still equal the torch twins (outputs, native's
    W states, compact's records)."""
    from lightllm.linear_att import ops

    gen = torch.Generator(device="cuda").manual_seed(N)
    _, H, HV, K, V = shape
    W, num_slots = 4, 8
    args = _inputs(shape, N, W, gen)
    GK = args[3].shape[-1]
    tokens = TokenInputs(*args)
    slots = torch.randperm(num_slots - 1, generator=gen, device="cuda")[:N].to(torch.int32)
    widths = torch.full((N,), W, dtype=torch.int32, device="cuda")
    base = torch.randn(num_slots, HV, K, V, generator=gen, device="cuda") * 0.05
    native = torch.full((num_slots, W, HV, K, V), float("nan"), device="cuda")
    native[:, 0] = base
    index = torch.zeros(num_slots, dtype=torch.int32, device="cuda")
    native_t = native.clone()
    o = ops.native_verify(tokens, NativeBuffers(native, index), slots, widths, backend="triton")
    o_t = ops.native_verify(tokens, NativeBuffers(native_t, index), slots, widths, backend="torch")
    assert_rel_close("native o", o, o_t, 2e-2)
    rows = slots.long()
    assert_rel_close("native states", native[rows], native_t[rows], 2e-2)

    def compact():
        win = [
            torch.full((num_slots, 2, W, *tail), float("nan"), device="cuda") for tail in ((H, K), (HV, V), (HV, GK))
        ]
        pending = torch.zeros(num_slots, dtype=torch.int32, device="cuda")
        return CompactBuffers(base.clone(), *win, pending, torch.zeros_like(pending))

    layer, layer_t = compact(), compact()
    o_c = ops.compact_verify(tokens, layer, slots, widths, backend="triton")
    o_ct = ops.compact_verify(tokens, layer_t, slots, widths, backend="torch")
    assert_rel_close("compact o", o_c, o_ct, 2e-2)
    assert_rel_close("compact records u", layer.win_u[rows, 1], layer_t.win_u[rows, 1], 2e-2)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("block_v", [16, 64], ids=["BV16", "BV64"])
def test_compact_lazy_commit_matches_native_over_rounds(shape, block_v):
    """Multi-round MTP: every compact verify merges the previous window's pending tokens (read from one buffer while
    the key owners of the launch write the other; many V tiles, grouped heads), outputs equal native's bitwise every
    round, and after a final commit the state equals native's current state byte for byte."""
    from lightllm.linear_att.kernels.serial import compact_commit_triton, compact_verify_triton, native_verify_triton

    gen = torch.Generator(device="cuda").manual_seed(5)
    algo, H, HV, K, V = shape
    GK = 1 if algo == "gdn" else K
    N, W, num_slots = 64, 4, 80
    cfg = KernelConfig(block_v=block_v, num_warps=4, num_stages=1)
    base = (torch.randn(num_slots, HV, K, V, generator=gen, device="cuda") * 0.05).to(torch.bfloat16)
    native = torch.zeros(num_slots, W, HV, K, V, device="cuda", dtype=torch.bfloat16)
    native[:, 0] = base
    index = torch.zeros(num_slots, dtype=torch.int32, device="cuda")
    ssm = base.clone()
    win = [
        torch.full((num_slots, 2, W, H, K), float("nan"), device="cuda"),
        torch.full((num_slots, 2, W, HV, V), float("nan"), device="cuda"),
        torch.full((num_slots, 2, W, HV, GK), float("nan"), device="cuda"),
    ]
    pending = torch.zeros(num_slots, dtype=torch.int32, device="cuda")
    parity = torch.zeros_like(pending)
    slots = torch.randperm(num_slots - 1, generator=gen, device="cuda")[:N].to(torch.int32)
    sl = slots.long()
    for rnd in range(12):
        args = _inputs(shape, N, W, gen)
        _, widths, accepted = _rows(N, W, gen, num_slots)
        if rnd % 4 == 1:
            accepted = widths.clamp(min=1)
        tokens = TokenInputs(*args)
        o = native_verify_triton(tokens, NativeBuffers(native, index), slots, widths, config=cfg)
        o_c = compact_verify_triton(tokens, CompactBuffers(ssm, *win, pending, parity), slots, widths, config=cfg)
        assert torch.equal(o_c, o), f"round {rnd}: compact outputs != native (bitwise)"
        live = widths > 0
        index[sl[live]] = accepted[live] - 1
        pending[sl[live]] = accepted[live]
        parity[sl[live]] = 1 - parity[sl[live]]
    compact_commit_triton(CompactBuffers(ssm[None], *(t[None] for t in win), pending, parity), slots, config=cfg)
    want = native[sl, index[sl].long()]
    assert torch.equal(ssm[sl].view(torch.uint8), want.view(torch.uint8)), "settled compact state != native"


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("projection", ["inline", "precompute"])
@pytest.mark.parametrize("state_dtype", STATE)
def test_replay_rounds_match_twin(shape, projection, state_dtype):
    gen = torch.Generator(device="cuda").manual_seed(1)
    N, W, L, num_slots = 64, 4, 8, 80
    rep = Replay(shape, num_slots, L, state_dtype, gen)
    twin = rep.clone()
    slots, _, _ = _rows(N, W, gen, num_slots)
    for r in range(7):
        args = _inputs(shape, N, W, gen)
        _, widths, accepted = _rows(N, W, gen, num_slots)
        o = _replay_step(rep, args, slots, widths, accepted, projection)
        o_t = _replay_step(twin, args, slots, widths, accepted, projection, backend="torch")
        assert not o.isnan().any(), f"round {r}: NaN (a poisoned record leaked)"
        assert_rel_close(f"round {r} o", o, o_t, 2e-2)
        assert_rel_close(
            f"round {r} ssm", rep.ssm.float(), twin.ssm.float(), 1e-2 if state_dtype != torch.float32 else 1e-4
        )
        assert torch.equal(rep.cursor, twin.cursor) and torch.equal(rep.parity, twin.parity)
        rep.poison_dead()
        twin.poison_dead()


def _round_matches_twin(rep, twin, r, args, slots, widths, accepted, projection, o_tol):
    """Round `r` of replay verify + accept on the kernels and on the torch twin: no poisoned record reaches an output;
    outputs (within `o_tol`), folded state, records and cursors agree; then both poison what is no longer live."""
    o = _replay_step(rep, args, slots, widths, accepted, projection)
    o_t = _replay_step(twin, args, slots, widths, accepted, projection, backend="torch")
    assert not o.isnan().any(), f"round {r}: NaN (a poisoned record leaked)"
    assert_rel_close(f"round {r} o", o.float(), o_t.float(), o_tol)
    assert_rel_close(f"round {r} ssm", rep.ssm, twin.ssm, 1e-5)
    for name, a, b in zip(("hist_k", "hist_u", "hist_g"), rep.hist, twin.hist):
        assert_rel_close(f"round {r} {name}", a.nan_to_num(), b.nan_to_num(), 1e-4)
    assert torch.equal(rep.cursor, twin.cursor) and torch.equal(rep.parity, twin.parity)
    rep.poison_dead()
    twin.poison_dead()


DECODE_SHAPES = [
    *SHAPES,
    pytest.param(("gdn", 2, 4, 16, 16), id="tiny-gdn"),
    pytest.param(("kda", 2, 2, 16, 16), id="tiny-kda"),
]


@pytest.mark.parametrize("shape", DECODE_SHAPES)
@pytest.mark.parametrize("act_dtype", [torch.float32, torch.bfloat16], ids=["fp32-act", "bf16-act"])
@pytest.mark.parametrize(
    ("W", "projection"), [(1, "inline"), (2, "inline"), (2, "precompute"), (4, "inline"), (4, "precompute")]
)
def test_replay_short_windows_match_twin(shape, act_dtype, W, projection):
    """Plain decode (W = 1, the one-launch kernel) and short verify windows at replay_capacity 4 (a fold every round or
    two), small and real head shapes, against the torch twin."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    N, L, num_slots = 24, 4, 30
    rep = Replay(shape, num_slots, L, torch.float32, gen)
    twin = rep.clone()
    slots, _, _ = _rows(N, W, gen, num_slots)
    for r in range(11):
        args = _inputs(shape, N, W, gen, act_dtype)
        _, widths, accepted = _rows(N, W, gen, num_slots)
        o_tol = 2e-2 if act_dtype == torch.bfloat16 else 1e-4
        _round_matches_twin(rep, twin, r, args, slots, widths, accepted, projection, o_tol)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("N", [1, 2])
@pytest.mark.parametrize(("W", "projection"), [(1, "inline"), (4, "inline"), (4, "precompute")])
def test_replay_small_batches_match_twin_under_the_looked_up_tile(shape, N, W, projection):
    """One or two rows launch replay decode / window with the looked-up tile narrowed for them (down to 16-wide V
    tiles, the precompute projection's dot minimum): outputs, folded state, records and cursors equal the twin's
    over rounds that fold (replay_capacity 4)."""
    gen = torch.Generator(device="cuda").manual_seed(10 * N + W)
    L, num_slots = 4, 6
    rep = Replay(shape, num_slots, L, torch.float32, gen)
    twin = rep.clone()
    slots = torch.randperm(num_slots - 1, generator=gen, device="cuda")[:N].to(torch.int32)
    for r in range(6):
        args = _inputs(shape, N, W, gen)
        widths = torch.full((N,), W, dtype=torch.int32, device="cuda")
        accepted = torch.randint(1, W + 1, (N,), generator=gen, device="cuda", dtype=torch.int32)
        _round_matches_twin(rep, twin, r, args, slots, widths, accepted, projection, 2e-2)


@pytest.mark.parametrize("shape", SHAPES)
def test_cuda_graph_replay_equals_eager_over_fold_cycles(shape):
    """verify + accept captured once; 12 replays (several folds per row) == 12 eager steps, bitwise."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    N, W, L, num_slots = 48, 4, 8, 64
    rep = Replay(shape, num_slots, L, torch.float32, gen)
    eager = rep.clone()
    args = _inputs(shape, N, W, gen)
    slots, widths, accepted = _rows(N, W, gen, num_slots)
    lower_bound = None
    outs_eager = [_replay_step(eager, args, slots, widths, accepted, "inline", lower_bound) for _ in range(12)]

    graphed = rep.clone()
    # the warm-up copy is made before the side stream waits: otherwise the side stream can read its cursor and
    # parity before the clone's copies land (garbage cursors address records far out of bounds)
    warm = rep.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _replay_step(warm, args, slots, widths, accepted, "inline")
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_static = _replay_step(graphed, args, slots, widths, accepted, "inline")
    # capture recorded the launches without running them: the graphed state is still the initial one
    for step in range(12):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(o_static, outs_eager[step]), f"step {step}: graph output != eager"
    assert torch.equal(graphed.ssm, eager.ssm) and torch.equal(graphed.cursor, eager.cursor)
    assert torch.equal(graphed.parity, eager.parity)
    for a, b in zip(graphed.hist, eager.hist):
        assert torch.equal(torch.nan_to_num(a, nan=7.0), torch.nan_to_num(b, nan=7.0))


@pytest.mark.parametrize("projection", ["inline", "precompute"])
def test_many_v_tiles_and_grouped_heads_are_race_free(projection):
    """Folds every step (L = W), 8 V tiles, 4 value heads per key head, 256 rows: the records and states of a
    tiled launch match a single-tile launch round after round (a cross-program race would corrupt them)."""
    shape = ("gdn", 8, 32, 128, 128)
    gen = torch.Generator(device="cuda").manual_seed(3)
    N, W, L, num_slots = 256, 4, 4, 260
    tiled = Replay(shape, num_slots, L, torch.float32, gen)
    single = tiled.clone()
    slots, _, _ = _rows(N, W, gen, num_slots)
    for r in range(6):
        args = _inputs(shape, N, W, gen, act_dtype=torch.float32)
        widths = torch.full((N,), W, dtype=torch.int32, device="cuda")
        accepted = torch.randint(1, W + 1, (N,), generator=gen, device="cuda", dtype=torch.int32)
        o = _replay_step(tiled, args, slots, widths, accepted, projection, config=KernelConfig(16, 2, 1))
        o1 = _replay_step(single, args, slots, widths, accepted, projection, config=KernelConfig(128, 8, 1))
        assert_rel_close(f"round {r} o", o, o1, 2e-3)
        assert_rel_close(f"round {r} ssm", tiled.ssm, single.ssm, 1e-5)
        for name, a, b in zip("kug", tiled.hist, single.hist):
            assert_rel_close(f"round {r} hist_{name}", torch.nan_to_num(a), torch.nan_to_num(b), 1e-5)


def test_kda_safe_gate_and_fold_match_twin():
    from lightllm.linear_att import ops

    gen = torch.Generator(device="cuda").manual_seed(4)
    N, W, L, num_slots = 32, 2, 4, 40
    rep = Replay(KIMI, num_slots, L, torch.float32, gen)
    twin = rep.clone()
    slots, _, _ = _rows(N, W, gen, num_slots)
    for _ in range(5):
        args = _inputs(KIMI, N, W, gen)
        _, widths, accepted = _rows(N, W, gen, num_slots)
        o = _replay_step(rep, args, slots, widths, accepted, "inline", lower_bound=-5.0)
        o_t = _replay_step(twin, args, slots, widths, accepted, "inline", lower_bound=-5.0, backend="torch")
        assert_rel_close("o", o, o_t, 2e-2)
    out = torch.empty(1, N, *rep.ssm.shape[1:], device="cuda")
    out_t = torch.empty_like(out)
    stacked = ReplayBuffers(rep.ssm[None], *(t[None] for t in rep.hist), rep.cursor, rep.parity)
    ops.replay_fold(stacked, slots, out=out, backend="triton")
    ops.replay_fold(stacked, slots, out=out_t, backend="torch")
    assert_rel_close("export fold", out, out_t, 1e-4)
