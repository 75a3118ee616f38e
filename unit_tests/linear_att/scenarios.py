"""Scenario drivers for the state-mode tests, reusable with any operator backend.

A scenario builds a state with `create_state`, feeds each request a deterministic token stream (pre-conv
`mixed_qkv`, raw gates) through prefill and multi-round verify/accept, and records the outputs of the accepted
tokens. `reference_outputs` runs the independent fp32 oracle (`gdn/reference.py`, `kda/reference.py`, plus a
plain conv) over the same accepted streams. Rejected window tokens get fresh random inputs, so a rejected token
that leaked into the state would change later outputs.

Kernel tests reuse everything by passing `backend="triton"` (and tiny shapes) to `make_state`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from lightllm.linear_att import LinearAttSpec, StateConfig, StateMode, create_state
from lightllm.linear_att.base import DecodeRows, LayerParams, PrefillRows
from lightllm.linear_att.gdn import reference as gdn_ref
from lightllm.linear_att.kda import reference as kda_ref
from lightllm.linear_att.modes.compact import CompactState
from lightllm.linear_att.modes.native import NativeState
from lightllm.linear_att.modes.replay import ReplayState
from unit_tests.helpers.asserts import poison_


def make_spec(algo="gdn", num_k_heads=2, ratio=2, head_k_dim=16, head_v_dim=16, num_layers=2, lower_bound=None):
    return LinearAttSpec(
        algo=algo,
        num_layers=num_layers,
        num_k_heads=num_k_heads,
        num_v_heads=num_k_heads * ratio,
        head_k_dim=head_k_dim,
        head_v_dim=head_v_dim,
        conv_kernel_size=4,
        gate_lower_bound=lower_bound,
    )


def make_state(
    spec,
    mode,
    *,
    max_requests=4,
    max_width=4,
    state_dtype=torch.float32,
    act_dtype=torch.float32,
    replay_capacity=8,
    projection="inline",
    backend=None,
):
    config = StateConfig(
        mode=StateMode(mode),
        max_requests=max_requests,
        max_width=max_width,
        state_dtype=state_dtype,
        act_dtype=act_dtype,
        replay_capacity=replay_capacity,
        projection=projection,
        backend=backend,
    )
    return create_state(spec, config)


def make_params(spec, seed=0) -> list[LayerParams]:
    gen = torch.Generator().manual_seed(seed)
    params = []
    for _ in range(spec.num_layers):
        params.append(
            LayerParams(
                conv_weight=torch.randn(spec.conv_dim, spec.conv_kernel_size, generator=gen) * 0.5,
                conv_bias=torch.randn(spec.conv_dim, generator=gen) * 0.1,
                A_log=torch.rand(spec.num_v_heads, generator=gen) * 1.5 - 1.0,
                dt_bias=torch.randn(spec.num_v_heads, spec.gate_dim, generator=gen) * 0.5,
            )
        )
    return params


@dataclass
class Streams:
    """Per layer, per request: inputs of every stream position (the tokens that end up accepted)."""

    x: list[list[torch.Tensor]]  # [layer][req] -> [T, C]
    graw: list[list[torch.Tensor]]  # [layer][req] -> [T, HV, GK]
    braw: list[list[torch.Tensor]]  # [layer][req] -> [T, HV]


def make_streams(spec, num_requests, length, seed=1, gate_shift=0.0, key_scale=1.0) -> Streams:
    gen = torch.Generator().manual_seed(seed)
    hv, gk = spec.num_v_heads, spec.gate_dim
    x, graw, braw = [], [], []
    for _ in range(spec.num_layers):
        x.append([torch.randn(length, spec.conv_dim, generator=gen) for _ in range(num_requests)])
        graw.append([torch.randn(length, hv, gk, generator=gen) + gate_shift for _ in range(num_requests)])
        braw.append([torch.randn(length, hv, generator=gen) for _ in range(num_requests)])
    if key_scale != 1.0:
        # shrink the key channels of the conv input (near-zero keys exercise the l2norm eps)
        key_cols = slice(spec.num_k_heads * spec.head_k_dim, 2 * spec.num_k_heads * spec.head_k_dim)
        for layer in x:
            for t in layer:
                t[:, key_cols] *= key_scale
    return Streams(x, graw, braw)


@dataclass
class Run:
    """Outputs of the accepted tokens, per layer and request, in stream order."""

    outputs: list[list[list[torch.Tensor]]] = field(default_factory=list)  # [layer][req] -> list of [HV, V]
    positions: list[int] = field(default_factory=list)  # stream position reached per request

    def stacked(self, layer, req) -> torch.Tensor:
        return torch.stack(self.outputs[layer][req])


def prefill(state, spec, params, streams, slots, lengths, run: Run, act_dtype=torch.float32, has_initial=None):
    """Prefill `lengths[i]` stream tokens of request i (from its current position) into `slots[i]`."""
    reqs = list(range(len(slots)))
    starts = [run.positions[i] for i in reqs]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32)
    has = torch.tensor([s > 0 for s in starts] if has_initial is None else has_initial)
    rows = PrefillRows(slots=torch.tensor(slots, dtype=torch.int32), cu_seqlens=cu, has_initial_state=has)
    for layer in range(spec.num_layers):
        x = torch.cat([streams.x[layer][i][starts[i] : starts[i] + lengths[i]] for i in reqs]).to(act_dtype)
        graw = torch.cat([streams.graw[layer][i][starts[i] : starts[i] + lengths[i]] for i in reqs])
        braw = torch.cat([streams.braw[layer][i][starts[i] : starts[i] + lengths[i]] for i in reqs])
        o = state.prefill(layer, rows, x, graw, braw, params[layer])
        for i in reqs:
            run.outputs[layer][i].extend(o[cu[i] : cu[i + 1]].float().unbind(0))
    state.finish_prefill(rows.slots)
    for i in reqs:
        run.positions[i] += lengths[i]


def verify_round(
    state, spec, params, streams, slots, widths, accepted, run: Run, gen, act_dtype=torch.float32, hold_rows=0
):
    """One decode step: row i verifies `widths[i]` tokens (0 = padding) and accepts `accepted[i]`.

    The first `accepted[i]` window tokens are the next stream tokens; the rest are fresh random (rejected).
    `hold_rows` extra padding rows on the HOLD slot are appended. Returns the raw outputs `[N, Wmax, HV, V]`.
    """
    n = len(slots)
    max_width = state.max_width
    hv, gk, c = spec.num_v_heads, spec.gate_dim, spec.conv_dim
    all_slots = list(slots) + [state.hold_slot] * hold_rows
    all_widths = list(widths) + [0] * hold_rows
    rows = DecodeRows(
        slots=torch.tensor(all_slots, dtype=torch.int32),
        widths=torch.tensor(all_widths, dtype=torch.int32),
        max_width=max_width,
    )
    num_rows = len(all_slots)
    result = None
    for layer in range(spec.num_layers):
        x = torch.randn(num_rows, max_width, c, generator=gen)
        graw = torch.randn(num_rows, max_width, hv, gk, generator=gen)
        braw = torch.randn(num_rows, max_width, hv, generator=gen)
        for i in range(n):
            a, p = accepted[i], run.positions[i]
            x[i, :a] = streams.x[layer][i][p : p + a]
            graw[i, :a] = streams.graw[layer][i][p : p + a]
            braw[i, :a] = streams.braw[layer][i][p : p + a]
        o = state.decode(layer, rows, x.to(act_dtype), graw, braw, params[layer])
        for i in range(n):
            run.outputs[layer][i].extend(o[i, : accepted[i]].float().unbind(0))
        result = o if result is None else result
    state.accept(rows, torch.tensor(list(accepted) + [1] * hold_rows, dtype=torch.int32))
    for i in range(n):
        run.positions[i] += accepted[i]
    return result


def new_run(spec, num_requests) -> Run:
    return Run(
        outputs=[[[] for _ in range(num_requests)] for _ in range(spec.num_layers)],
        positions=[0] * num_requests,
    )


def poison_dead(state) -> None:
    """NaN every byte the state must not read again: rejected/stale history, dead native slots, the compact window
    buffer not holding pending tokens and the rejected tokens of the one that does."""
    if isinstance(state, ReplayState):
        cap = state.replay_capacity
        for slot in range(state.num_slots):
            h, p = int(state.cursor[slot]), int(state.parity[slot])
            for t in (state.hist_k, state.hist_u, state.hist_g):
                poison_(t[:, slot, 1 - p])
                if h < cap:
                    poison_(t[:, slot, p, h:])
    elif isinstance(state, CompactState):
        # only the accepted, not yet merged tokens of the current buffer are live
        for slot in range(state.num_slots):
            a, p = int(state.pending[slot]), int(state.parity[slot])
            for t in (state.win_k, state.win_u, state.win_g):
                poison_(t[:, slot, 1 - p])
                poison_(t[:, slot, p, a:])
    elif isinstance(state, NativeState):
        for slot in range(state.num_slots):
            cur = int(state.ssm_index[slot])
            for w in range(state.max_width):
                if w != cur:
                    poison_(state.ssm[:, slot, w])


def reference_outputs(spec, params, streams, layer, req, length, round_state_to=None) -> torch.Tensor:
    """fp32 oracle over the first `length` stream tokens of one request: conv (zero history) + recurrence."""
    x = streams.x[layer][req][:length].float()
    p = params[layer]
    kc = spec.conv_kernel_size
    y = F.conv1d(
        F.pad(x.T[None], (kc - 1, 0)), p.conv_weight.float()[:, None, :], p.conv_bias.float(), groups=spec.conv_dim
    )
    y = F.silu(y[0].T)
    key_dim = spec.num_k_heads * spec.head_k_dim
    q = y[:, :key_dim].reshape(length, spec.num_k_heads, spec.head_k_dim)
    k = y[:, key_dim : 2 * key_dim].reshape(length, spec.num_k_heads, spec.head_k_dim)
    v = y[:, 2 * key_dim :].reshape(length, spec.num_v_heads, spec.head_v_dim)
    graw, braw = streams.graw[layer][req][:length], streams.braw[layer][req][:length]
    if spec.algo == "gdn":
        g = gdn_ref.gdn_gate(graw[..., 0], p.A_log, p.dt_bias[:, 0])
        o, _ = gdn_ref.recurrent_gated_delta_rule(q, k, v, g, gdn_ref.gdn_beta(braw), round_state_to=round_state_to)
    else:
        g = kda_ref.kda_gate(graw, p.A_log, p.dt_bias, spec.gate_lower_bound)
        o, _ = kda_ref.recurrent_kda(q, k, v, g, kda_ref.kda_beta(braw), round_state_to=round_state_to)
    return o


def reference_state(spec, params, streams, layer, req, length) -> torch.Tensor:
    """fp32 oracle state `[HV, K, V]` after the first `length` stream tokens of one request."""
    x = streams.x[layer][req][:length].float()
    p = params[layer]
    kc = spec.conv_kernel_size
    y = F.conv1d(
        F.pad(x.T[None], (kc - 1, 0)), p.conv_weight.float()[:, None, :], p.conv_bias.float(), groups=spec.conv_dim
    )
    y = F.silu(y[0].T)
    key_dim = spec.num_k_heads * spec.head_k_dim
    q = y[:, :key_dim].reshape(length, spec.num_k_heads, spec.head_k_dim)
    k = y[:, key_dim : 2 * key_dim].reshape(length, spec.num_k_heads, spec.head_k_dim)
    v = y[:, 2 * key_dim :].reshape(length, spec.num_v_heads, spec.head_v_dim)
    graw, braw = streams.graw[layer][req][:length], streams.braw[layer][req][:length]
    if spec.algo == "gdn":
        g = gdn_ref.gdn_gate(graw[..., 0], p.A_log, p.dt_bias[:, 0])
        _, s = gdn_ref.recurrent_gated_delta_rule(q, k, v, g, gdn_ref.gdn_beta(braw))
    else:
        g = kda_ref.kda_gate(graw, p.A_log, p.dt_bias, spec.gate_lower_bound)
        _, s = kda_ref.recurrent_kda(q, k, v, g, kda_ref.kda_beta(braw))
    return s[0]


def choose_round(gen, num_requests, r, max_width, policy):
    """Widths and accepted counts of round `r` (see `run_mtp` for the policies)."""
    widths, accepted = [], []
    for _ in range(num_requests):
        if policy == "decode":
            w, a = 1, 1
        else:
            w = max_width if policy != "random" else int(torch.randint(0, max_width + 1, (1,), generator=gen))
            if policy == "random" and r % 7 == 0:
                w = max_width
            if w == 0:
                a = 0
            elif policy == "all_accept" or (policy == "random" and r % 5 == 1):
                a = w
            elif policy == "all_reject" or (policy == "random" and r % 5 == 2):
                a = 1
            else:
                a = int(torch.randint(1, w + 1, (1,), generator=gen))
        widths.append(w)
        accepted.append(a)
    return widths, accepted


def rounds(
    state,
    spec,
    params,
    streams,
    slots,
    run,
    *,
    num_rounds,
    max_width,
    seed=0,
    policy="random",
    poison=True,
    act_dtype=torch.float32,
    hold_rows=1,
    on_round=None,
) -> None:
    """`num_rounds` verify rounds; `on_round(r)` runs after each accept (and poisoning)."""
    gen = torch.Generator().manual_seed(seed)
    for r in range(num_rounds):
        widths, accepted = choose_round(gen, len(slots), r, max_width, policy)
        verify_round(state, spec, params, streams, slots, widths, accepted, run, gen, act_dtype, hold_rows)
        if poison:
            poison_dead(state)
        if on_round is not None:
            on_round(r)


def run_mtp(
    state,
    spec,
    params,
    streams,
    *,
    prompt_lens,
    num_rounds,
    max_width,
    seed=0,
    policy="random",
    poison=True,
    act_dtype=torch.float32,
    hold_rows=1,
) -> tuple[Run, list[int]]:
    """Prefill every request, then `num_rounds` verify rounds with per-row widths and accepted counts.

    policy: "random" (width in [0, Wmax] per row per round, i.e. some zero-width rows; accepted in [1, W]; every
    7th round full width, every 5th all-accept / all-reject), "all_accept", "all_reject", "decode" (W = 1).
    Returns the run and the allocated slots.
    """
    slots = [state.alloc() for _ in prompt_lens]
    run = new_run(spec, len(prompt_lens))
    prefill(state, spec, params, streams, slots, prompt_lens, run, act_dtype)
    rounds(
        state,
        spec,
        params,
        streams,
        slots,
        run,
        num_rounds=num_rounds,
        max_width=max_width,
        seed=seed,
        policy=policy,
        poison=poison,
        act_dtype=act_dtype,
        hold_rows=hold_rows,
    )
    return run, slots


def state_tensors(state) -> dict[str, torch.Tensor]:
    """Every per-slot tensor attribute of a state object (for byte comparisons); 0-dim counters are not per slot."""
    return {name: t for name, t in vars(state).items() if isinstance(t, torch.Tensor) and t.dim() > 0}


def max_output_error(spec, params, streams, run: Run, round_state_to=None) -> float:
    """Largest relative error of any (layer, request) accepted-output stream against the fp32 oracle."""
    from unit_tests.helpers.asserts import relative_error

    worst = 0.0
    for layer in range(spec.num_layers):
        for req, n in enumerate(run.positions):
            ref = reference_outputs(spec, params, streams, layer, req, n, round_state_to)
            worst = max(worst, relative_error(run.stacked(layer, req), ref))
    return worst
