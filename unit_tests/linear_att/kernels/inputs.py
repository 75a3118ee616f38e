"""Random verify inputs and an fp32 oracle per row, shared by the kernel tests (tiny odd shapes, explicit seeds)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightllm.linear_att.autotune import KernelConfig
from lightllm.linear_att.bundles import TokenInputs
from lightllm.linear_att.gdn import reference as gdn_ref
from lightllm.linear_att.kda import reference as kda_ref

# two V tiles at V = 16 (BV = 8): every test covers the tiling
TILED = KernelConfig(block_v=8, num_warps=1, num_stages=1)
LOWER_BOUND = -5.0


@dataclass
class Shape:
    algo: str  # "gdn" | "kda" | "kda_safe"
    H: int
    ratio: int
    K: int = 16
    V: int = 16

    @property
    def HV(self) -> int:
        return self.H * self.ratio

    @property
    def GK(self) -> int:
        return 1 if self.algo == "gdn" else self.K

    @property
    def lower_bound(self) -> float | None:
        return LOWER_BOUND if self.algo == "kda_safe" else None

    def __str__(self) -> str:
        return f"{self.algo}-H{self.H}xG{self.ratio}"


SHAPES = [Shape("gdn", 1, 1), Shape("gdn", 2, 2), Shape("gdn", 1, 4), Shape("kda", 2, 1), Shape("kda_safe", 1, 2)]


@dataclass
class Window:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    graw: torch.Tensor
    braw: torch.Tensor

    def tokens(self, params: Params, lower_bound: float | None = None) -> TokenInputs:
        return TokenInputs(
            self.q, self.k, self.v, self.graw, self.braw, params.A_log, params.dt_bias, lower_bound=lower_bound
        )


@dataclass
class Params:
    A_log: torch.Tensor
    dt_bias: torch.Tensor


def make_params(shape: Shape, gen: torch.Generator) -> Params:
    return Params(
        A_log=torch.rand(shape.HV, generator=gen) * 1.5 - 1.0,
        dt_bias=torch.randn(shape.HV, shape.GK, generator=gen) * 0.5,
    )


def make_window(shape: Shape, num_rows: int, max_width: int, act_dtype, gen: torch.Generator) -> Window:
    def rnd(*size):
        return torch.randn(*size, generator=gen)

    return Window(
        q=rnd(num_rows, max_width, shape.H, shape.K).to(act_dtype),
        k=rnd(num_rows, max_width, shape.H, shape.K).to(act_dtype),
        v=rnd(num_rows, max_width, shape.HV, shape.V).to(act_dtype),
        graw=rnd(num_rows, max_width, shape.HV, shape.GK),
        braw=rnd(num_rows, max_width, shape.HV),
    )


def reference_row(shape: Shape, params: Params, win: Window, row: int, width: int, state0, round_state_to=None):
    """fp32 oracle for one row: (outputs `[W, HV, V]`, states after each token `[W, HV, K, V]`)."""
    q, k, v = win.q[row, :width].float(), win.k[row, :width].float(), win.v[row, :width].float()
    graw, braw = win.graw[row, :width], win.braw[row, :width]
    outs, states = [], []
    S = state0.float()[None]
    for s in range(width):
        sl = slice(s, s + 1)
        if shape.algo == "gdn":
            g = gdn_ref.gdn_gate(graw[sl, :, 0], params.A_log, params.dt_bias[:, 0])
            o, S = gdn_ref.recurrent_gated_delta_rule(
                q[sl], k[sl], v[sl], g, gdn_ref.gdn_beta(braw[sl]), initial_state=S, round_state_to=round_state_to
            )
        else:
            g = kda_ref.kda_gate(graw[sl], params.A_log, params.dt_bias, shape.lower_bound)
            o, S = kda_ref.recurrent_kda(
                q[sl], k[sl], v[sl], g, kda_ref.kda_beta(braw[sl]), initial_state=S, round_state_to=round_state_to
            )
        outs.append(o[0])
        states.append(S[0])
    return torch.stack(outs), torch.stack(states)
