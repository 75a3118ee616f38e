"""The cases of `memcheck_kernels.py`: the served and tiny linear-attention head shapes, and one builder per state
kernel family (conv prefill / decode, native, compact, replay, the cursor kernels) plus the state classes' own call
sequence, each returning the function a case runs on its `Ctx` (device, seeded generator, exact-size allocations).
`build_cases` lists them, the shared model kernels' cases (`memcheck_model_cases.py`) and the layers' glue kernels'
(`memcheck_elementwise_cases.py`), with the kernels each must launch."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from unittest import mock

from memcheck_common import Case, Ctx
from memcheck_elementwise_cases import build_elementwise_cases
from memcheck_model_cases import build_model_cases

# ---------------------------------------------------------------------------------------------------------------
# shapes


@dataclass(frozen=True)
class StateShape:
    """Linear-attention head shapes of one served (or tiny) model, with its dtypes and replay replay_capacity."""

    name: str
    algo: str  # "gdn" | "kda" | "kda_safe" (bounded KDA gate), as in unit_tests/linear_att/kernels/inputs.py
    H: int
    ratio: int  # HV / H
    K: int
    V: int
    act: str  # activation dtype name
    state: str  # SSM state dtype name
    conv_kernel: int
    replay_capacity: int  # replay history replay_capacity L
    tiny: bool

    def inputs_shape(self):
        from unit_tests.linear_att.kernels.inputs import Shape

        return Shape(self.algo, self.H, self.ratio, self.K, self.V)

    @property
    def HV(self) -> int:
        return self.H * self.ratio

    @property
    def conv_dim(self) -> int:
        return 2 * self.H * self.K + self.HV * self.V


STATE_SHAPES = (
    # the served layouts: bf16 activations, fp32 state (the server's default), replay replay_capacity 8 (its default)
    StateShape("qwen3-next", "gdn", 16, 2, 128, 128, "bfloat16", "float32", 4, 8, tiny=False),
    StateShape("qwen3.5", "gdn", 16, 4, 128, 128, "bfloat16", "float32", 4, 8, tiny=False),
    StateShape("kimi-linear", "kda", 32, 1, 128, 128, "bfloat16", "float32", 4, 8, tiny=False),
    # odd tiny shapes (the CPU interpreter has no bf16: fp16 / fp32 here); partial key, value and channel tiles
    StateShape("tiny-gdn", "gdn", 3, 2, 24, 24, "float32", "float16", 4, 4, tiny=True),
    StateShape("tiny-kda", "kda_safe", 3, 1, 20, 36, "float16", "float32", 3, 4, tiny=True),
)


def verify_rows(n: int, w: int, seed: int) -> tuple[list[int], list[int], list[int], int]:
    """Rows of a verify batch of `n` rows over `n + 1` slots (the last is HOLD): (slots, widths, accepted,
    num_slots). Row 0 is on the highest real slot at full width; for `n` >= 3, row 1 is the HOLD slot (width 0), row
    2 slot 0, row 3 a padding row on a real slot, the rest random widths in [1, w] (one of them full). One row (a
    batch the kernels launch with a narrowed V tile) is slot 0 at full width."""
    import random

    rnd = random.Random(seed)
    num_slots = n + 1
    if n == 1:
        return [0], [w], [rnd.randint(1, w)], num_slots
    assert n >= 3, "a verify batch of the memcheck cases has one row or at least three"
    hold = num_slots - 1
    rest = list(range(1, n - 2))
    rnd.shuffle(rest)
    slots = [hold - 1, hold, 0, *rest]
    widths = [w, 0, max(1, w - 1)] + [0 if i == 3 else (w if i == 4 else rnd.randint(1, w)) for i in range(3, n)]
    accepted = [rnd.randint(1, x) if x else 1 for x in widths]
    return slots, widths, accepted, num_slots


def _window(ctx: Ctx, shape: StateShape, n: int, w: int):
    """The verify's `TokenInputs` at exact sizes (unit_tests/linear_att/kernels/inputs.py)."""
    from lightllm.linear_att.bundles import TokenInputs
    from unit_tests.linear_att.kernels.inputs import make_params, make_window

    s = shape.inputs_shape()
    win = make_window(s, n, w, ctx.dtype(shape.act), ctx.cpu_gen)
    params = make_params(s, ctx.cpu_gen)
    parts = (win.q, win.k, win.v, win.graw, win.braw, params.A_log, params.dt_bias)
    return TokenInputs(*(ctx.to_device(t) for t in parts), lower_bound=s.lower_bound)


def _gk(shape: StateShape) -> int:
    return 1 if shape.algo == "gdn" else shape.K


NUM_LAYERS = 2  # per-layer storage: layer 1 (the last) ends at its allocation


def case_conv_prefill(shape: StateShape, lengths: list[int], max_width: int, padding: int = 0) -> Callable[[Ctx], str]:
    """`padding`: x holds that many tokens past the last row (a prefill padded to a graph's token bucket); their
    outputs are unspecified and only the rows' outputs are checked."""

    def run(ctx: Ctx) -> str:
        from lightllm.linear_att import ops

        torch = ctx.torch
        n, c, kc = len(lengths), shape.conv_dim, shape.conv_kernel
        num_slots = n + 1
        # rows on the highest slot first, slot 0 last; x ends exactly with the last row
        slots = ctx.ints([num_slots - 1 - i if i % 2 == 0 else i // 2 for i in range(n)])
        cu = ctx.ints([0, *torch.tensor(lengths).cumsum(0).tolist()])
        has_init = torch.tensor([i % 3 != 1 for i in range(n)], device=ctx.device)
        conv = ctx.randn(num_slots, c, kc - 1 + max_width - 1, dtype=shape.act)
        offset = ctx.ints([(3 * i + 1) % max_width for i in range(num_slots)])
        x = ctx.randn(sum(lengths) + padding, c, dtype=shape.act)
        weight = ctx.randn(c, kc, dtype=shape.act, scale=0.5)
        bias = ctx.randn(c, dtype=shape.act, scale=0.1)
        for b in (bias, None):  # the served GDN / KDA conv has no bias
            y = ops.causal_conv_prefill(x, conv, offset, slots, cu, weight, b, has_init, backend="triton")
            assert y.shape == x.shape and bool(torch.isfinite(y[: sum(lengths)]).all()), "non-finite conv outputs"
        return f"T={sum(lengths)}" + (f" + {padding} padding" if padding else "")

    return run


def case_conv_decode(shape: StateShape, n: int, w: int) -> Callable[[Ctx], str]:
    def run(ctx: Ctx) -> None:
        from lightllm.linear_att import ops

        slots, widths, _, num_slots = verify_rows(n, w, seed=w)
        c, kc = shape.conv_dim, shape.conv_kernel
        conv = ctx.randn(num_slots, c, kc - 1 + w - 1, dtype=shape.act)
        offset = ctx.ints([i % w for i in range(num_slots)])
        x = ctx.randn(n, w, c, dtype=shape.act)
        weight = ctx.randn(c, kc, dtype=shape.act, scale=0.5)
        bias = ctx.randn(c, dtype=shape.act, scale=0.1)
        for b in (None, bias):
            ops.causal_conv_decode(x, conv, offset, ctx.ints(slots), ctx.ints(widths), weight, b, backend="triton")

    return run


def case_native(shape: StateShape, n: int, w: int) -> Callable[[Ctx], None]:
    def run(ctx: Ctx) -> None:
        from lightllm.linear_att import ops
        from lightllm.linear_att.bundles import NativeBuffers
        from lightllm.linear_att.kernels.cursor import native_accept_triton

        slots, widths, accepted, num_slots = verify_rows(n, w, seed=10 + w)
        tokens = _window(ctx, shape, n, w)
        ssm = ctx.randn(num_slots, w, shape.HV, shape.K, shape.V, dtype=shape.state, scale=0.1)
        index = ctx.ints([(5 * i) % w for i in range(num_slots)])
        state = NativeBuffers(ssm, index)
        o = ops.native_verify(tokens, state, ctx.ints(slots), ctx.ints(widths), backend="triton")
        assert bool(ctx.torch.isfinite(o).all()), "non-finite native outputs"
        conv_offset = ctx.ints([0] * num_slots)
        native_accept_triton(index, conv_offset, ctx.ints(slots), ctx.ints(widths), ctx.ints(accepted))

    return run


def _compact_buffers(ctx: Ctx, shape: StateShape, num_slots: int, w: int):
    lead = (NUM_LAYERS, num_slots, 2, w)
    ssm = ctx.randn(NUM_LAYERS, num_slots, shape.HV, shape.K, shape.V, dtype=shape.state, scale=0.1)
    # fp32 records: k̂, u, g (activated log decay <= 0)
    win = [
        ctx.randn(*lead, shape.H, shape.K, dtype="float32", scale=0.25),
        ctx.randn(*lead, shape.HV, shape.V, dtype="float32", scale=0.1),
        -ctx.rand(*lead, shape.HV, _gk(shape), scale=0.5),
    ]
    return ssm, win


def case_compact(shape: StateShape, n: int, w: int) -> Callable[[Ctx], None]:
    def run(ctx: Ctx) -> None:
        from lightllm.linear_att import ops
        from lightllm.linear_att.bundles import CompactBuffers

        torch = ctx.torch
        slots, widths, accepted, num_slots = verify_rows(n, w, seed=20 + w)
        ssm, win = _compact_buffers(ctx, shape, num_slots, w)
        # pending tokens on every slot: the first verify merges them inside the kernel
        pending = ctx.ints([1 + i % w for i in range(num_slots)])
        parity = ctx.ints([i % 2 for i in range(num_slots)])
        sl, wd = ctx.ints(slots), ctx.ints(widths)
        for _ in range(2):
            for layer in range(NUM_LAYERS):
                layer_state = CompactBuffers(ssm[layer], *(t[layer] for t in win), pending, parity)
                o = ops.compact_verify(_window(ctx, shape, n, w), layer_state, sl, wd, backend="triton")
                assert bool(torch.isfinite(o).all()), "non-finite compact outputs"
            # CompactState.accept (torch): the window just written holds the accepted tokens
            for slot, width, a in zip(slots, widths, accepted):
                if width:
                    pending[slot], parity[slot] = a, 1 - parity[slot]
        all_layers = CompactBuffers(ssm, *win, pending, parity)
        ops.compact_commit(all_layers, sl, backend="triton")
        # checkpoint export: merge into gathered copies (fresh exact allocations), rows 0..n-1
        copies = all_layers.gathered(torch.tensor(slots, device=ctx.device))
        ops.compact_commit(copies, ctx.ints(range(n)), backend="triton")

    return run


def _replay_buffers(ctx: Ctx, shape: StateShape, num_slots: int, cap: int):
    lead = (NUM_LAYERS, num_slots, 2, cap)
    ssm = ctx.randn(NUM_LAYERS, num_slots, shape.HV, shape.K, shape.V, dtype=shape.state, scale=0.1)
    hist_k = ctx.randn(*lead, shape.H, shape.K, scale=0.2)
    hist_u = ctx.randn(*lead, shape.HV, shape.V, scale=0.1)
    hist_g = -ctx.rand(*lead, shape.HV, _gk(shape), scale=0.2).cumsum(3)  # cumulative gate since S0, decreasing
    return ssm, hist_k, hist_u, hist_g


def case_replay(shape: StateShape, n: int, w: int, projection: str) -> Callable[[Ctx], str]:
    def run(ctx: Ctx) -> str:
        from lightllm.linear_att import ops
        from lightllm.linear_att.bundles import ReplayBuffers

        torch = ctx.torch
        cap = shape.replay_capacity
        slots, widths, accepted, num_slots = verify_rows(n, w, seed=30 + w)
        ssm, hist_k, hist_u, hist_g = _replay_buffers(ctx, shape, num_slots, cap)
        # row 0 has a full history (folds inside the verify), row 2 an empty one; the rest anywhere in [0, L]
        cursor = [(7 * i + 3) % (cap + 1) for i in range(num_slots)]
        cursor[slots[0]], cursor[num_slots - 1] = cap, 0
        if n >= 3:
            cursor[slots[2]] = 0
        cursor = ctx.ints(cursor)
        parity = ctx.ints([i % 2 for i in range(num_slots)])
        conv_offset = ctx.ints([0] * num_slots)
        sl, wd, acc = ctx.ints(slots), ctx.ints(widths), ctx.ints(accepted)
        folds = 0
        for _ in range(2):
            folds += int(((wd > 0) & (cursor[sl.long()] + wd > cap)).sum())
            for layer in range(NUM_LAYERS):
                layer_state = ReplayBuffers(ssm[layer], hist_k[layer], hist_u[layer], hist_g[layer], cursor, parity)
                o = ops.replay_verify(
                    _window(ctx, shape, n, w), layer_state, sl, wd, projection=projection, backend="triton"
                )
                assert bool(torch.isfinite(o).all()), "non-finite replay outputs"
            ops.replay_accept(cursor, parity, conv_offset, sl, wd, acc, cap, backend="triton")
        assert folds > 0, "no row folded: the case misses the fold path"
        # the standalone fold: in place (prefill) and into an export buffer, all layers in one launch
        all_layers = ReplayBuffers(ssm, hist_k, hist_u, hist_g, cursor, parity)
        ops.replay_fold(all_layers, sl, backend="triton")
        out = torch.empty(NUM_LAYERS, n, shape.HV, shape.K, shape.V, dtype=ssm.dtype, device=ctx.device)
        ops.replay_fold(all_layers, sl, out=out, backend="triton")
        return f"{folds} row folds in verify"

    return run


def case_cursor(n: int) -> Callable[[Ctx], None]:
    """More rows than one program's block (1024): the accept kernels' row masks."""

    def run(ctx: Ctx) -> None:
        from lightllm.linear_att import ops
        from lightllm.linear_att.kernels.cursor import native_accept_triton

        num_slots = n + 1
        perm = ctx.torch.randperm(n, generator=ctx.cpu_gen).tolist()
        slots = [n - 1, n, *[s for s in perm if s != n - 1][: n - 2]]
        widths = [4, 0, *[(i % 5) for i in range(n - 2)]]
        accepted = [max(1, x // 2) for x in widths]
        sl, wd, acc = ctx.ints(slots), ctx.ints(widths), ctx.ints(accepted)
        cursor = ctx.ints([i % 9 for i in range(num_slots)])
        parity, offset = ctx.ints([0] * num_slots), ctx.ints([0] * num_slots)
        ops.replay_accept(cursor, parity, offset, sl, wd, acc, 8, backend="triton")
        native_accept_triton(ctx.ints([0] * num_slots), offset, sl, wd, acc)

    return run


class _OnDevice:
    """A state on the case's device behind the CPU-tensor interface of the scenario drivers
    (`unit_tests/linear_att/scenarios.py`): tensor arguments move to the device (each a fresh exact-size
    allocation), outputs come back to the CPU."""

    def __init__(self, state, device):
        self.state, self.device = state, device

    def __getattr__(self, name):
        return getattr(self.state, name)

    def _rows(self, rows):
        moved = {
            f.name: getattr(rows, f.name).to(self.device)
            for f in dataclasses.fields(rows)
            if hasattr(getattr(rows, f.name), "to")
        }
        return dataclasses.replace(rows, **moved)

    def prefill(self, layer, rows, x, graw, braw, params):
        d = self.device
        return self.state.prefill(layer, self._rows(rows), x.to(d), graw.to(d), braw.to(d), params).cpu()

    def decode(self, layer, rows, x, graw, braw, params):
        d = self.device
        return self.state.decode(layer, self._rows(rows), x.to(d), graw.to(d), braw.to(d), params).cpu()

    def accept(self, rows, num_accepted):
        self.state.accept(self._rows(rows), num_accepted.to(self.device))

    def finish_prefill(self, slots):
        self.state.finish_prefill(slots.to(self.device))


# prompt lengths (the last `requests` of them): the last row ends x and is no multiple of 16; a second chunk later
# (an empty row in it) prefills on top of the decode rounds' pending tokens / history
FIRST_CHUNK = (19, 1, 37, 2, 5, 23)
SECOND_CHUNK = (13, 2, 9, 1, 0, 21)


def case_state(shape: StateShape, mode: str, requests: int, w: int, projection: str = "inline") -> Callable:
    """The server's call sequence on a state object: prefill, verify/accept rounds (replay: through a fold), a second
    prefill chunk, checkpoint export and import."""

    def run(ctx: Ctx) -> str:
        from lightllm.linear_att import LinearAttSpec, StateConfig, StateMode, create_state, ops
        from lightllm.linear_att.base import Checkpoint, LayerParams
        from unit_tests.linear_att import scenarios as sc

        torch = ctx.torch
        act = ctx.dtype(shape.act)
        spec = LinearAttSpec(
            shape.algo.removesuffix("_safe"),
            NUM_LAYERS,
            shape.H,
            shape.HV,
            shape.K,
            shape.V,
            shape.conv_kernel,
            -5.0 if shape.algo == "kda_safe" else None,
        )
        config = StateConfig(
            StateMode(mode),
            max_requests=requests,
            max_width=w,
            state_dtype=ctx.dtype(shape.state),
            act_dtype=act,
            replay_capacity=shape.replay_capacity,
            projection=projection,
            device=ctx.device,
            backend="triton",
        )
        state = create_state(spec, config)
        params = [
            LayerParams(p.conv_weight.to(ctx.device, act), None, p.A_log.to(ctx.device), p.dt_bias.to(ctx.device))
            for p in sc.make_params(spec, seed=1)
        ]
        streams = sc.make_streams(spec, requests, 96, seed=2)
        dev = _OnDevice(state, ctx.device)
        chunk = functools.partial(ops.chunk_delta_rule, backend="torch")  # fla-core's kernels are not ours
        with mock.patch.object(ops, "chunk_delta_rule", chunk):
            if mode == "replay":  # all-accept rounds until every live row's history is full, then one fold round
                policy, num_rounds = "all_accept", shape.replay_capacity // w + 1
            else:
                policy, num_rounds = "random", 2
            run, slots = sc.run_mtp(
                dev,
                spec,
                params,
                streams,
                prompt_lens=list(FIRST_CHUNK[-requests:]),
                num_rounds=num_rounds,
                max_width=w,
                policy=policy,
                poison=False,
                act_dtype=act,
            )
            sc.rounds(
                dev, spec, params, streams, slots, run, num_rounds=1, max_width=w, seed=5, poison=False, act_dtype=act
            )
            sc.prefill(dev, spec, params, streams, slots, list(SECOND_CHUNK[-requests:]), run, act)
            sc.rounds(
                dev, spec, params, streams, slots, run, num_rounds=1, max_width=w, seed=6, poison=False, act_dtype=act
            )
        note = ""
        if mode == "replay":
            folds = int(state.num_folds)
            assert folds > 0, "no row folded: the case misses the fold path"
            note = f"{folds} row folds"
        for layer in run.outputs:
            for outs in layer:
                assert bool(torch.isfinite(torch.stack(outs)).all()), "non-finite outputs"
        ckpt = state.export_checkpoint(ctx.ints(slots))
        state.free(slots[0])
        new = state.alloc()
        state.import_checkpoint(ctx.ints([new]), Checkpoint(conv=ckpt.conv[:, -1:], ssm=ckpt.ssm[:, -1:]))
        return note

    return run


def build_cases() -> list[Case]:
    cases = []
    conv_p, conv_d = ("causal_conv_prefill_kernel", "causal_conv_prefill_tail_kernel"), ("causal_conv_decode_kernel",)
    native = ("serial_verify_kernel", "native_accept_kernel")
    compact = ("serial_verify_kernel", "compact_commit_kernel")
    replay_tail = ("replay_accept_kernel", "replay_fold_kernel")
    for s in STATE_SHAPES:

        def add(family, detail, kernels, run, s=s):
            cases.append(Case(family, s.name, detail, kernels, s.tiny, run))

        # packed prefill rows: lengths over / under the 16-token tile, empty and one-token rows, a row shorter than
        # the conv history; the last row ends x with a length that is no multiple of 16; a long row beside short
        # ones, its tiles spread over several programs
        for lengths, wmax in (([17, 0, 29], 1), ([5, 0, 1, 37, 2, 16, 23], 4), ([1100, 0, 3], 2)):
            add(
                "conv_prefill",
                f"N={len(lengths)} lens={'-'.join(map(str, lengths))} Wmax={wmax}",
                conv_p,
                case_conv_prefill(s, lengths, wmax),
            )
        # one row padded to a token bucket, as a prefill replayed from a CUDA graph launches it
        add("conv_prefill", "N=1 lens=23 Wmax=2 padded to 32", conv_p, case_conv_prefill(s, [23], 2, padding=9))
        for n, w in ((7, 1), (3, 2), (7, 4), (3, 4)):
            add("conv_decode", f"N={n} W={w}", conv_d, case_conv_decode(s, n, w))
        # the one-row cases launch the looked-up tile narrowed for a batch that cannot fill the GPU
        for n, w in ((3, 1), (7, 2), (3, 4), (7, 4), (1, 1), (1, 4)):
            add("native", f"N={n} W={w}", native, case_native(s, n, w))
        for n, w in ((7, 2), (3, 4), (1, 4)):
            add("compact", f"N={n} W={w} merge+commit+export", compact, case_compact(s, n, w))
        for n, w, proj in (
            (3, 1, "inline"),
            (7, 2, "inline"),
            (3, 2, "precompute"),
            (7, 4, "precompute"),
            (3, 4, "inline"),
            (1, 1, "inline"),
            (1, 4, "precompute"),
        ):
            kernel = "replay_decode_kernel" if w == 1 else "replay_window_kernel"
            add(
                "replay",
                f"N={n} W={w} L={s.replay_capacity} {proj} fold",
                (kernel, *replay_tail),
                case_replay(s, n, w, proj),
            )
        # the state classes (N rows = requests + 1 HOLD padding row)
        for mode, requests, w, proj in (
            ("native", 2, 1, "inline"),
            ("native", 6, 4, "inline"),
            ("compact", 6, 2, "inline"),
            ("compact", 2, 4, "inline"),
            ("replay", 2, 1, "inline"),
            ("replay", 6, 2, "precompute"),
            ("replay", 2, 4, "precompute"),
            ("replay", 6, 4, "inline"),
        ):
            kernels = conv_p + conv_d
            kernels += {
                "native": ("serial_verify_kernel",),
                "compact": compact,
                "replay": ("replay_decode_kernel" if w == 1 else "replay_window_kernel", *replay_tail),
            }[mode]
            detail = f"{mode} N={requests + 1} W={w}" + (f" L={s.replay_capacity} {proj}" if mode == "replay" else "")
            add("state", detail, kernels, case_state(s, mode, requests, w, proj))
    cases.append(
        Case(
            "cursor",
            "-",
            "N=1031 (two row blocks)",
            ("replay_accept_kernel", "native_accept_kernel"),
            True,
            case_cursor(1031),
        )
    )
    cases += build_model_cases()
    cases += build_elementwise_cases()
    return cases
