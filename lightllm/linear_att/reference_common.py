"""What the two torch oracles (`gdn/reference.py`, `kda/reference.py`) share: the token preparation (l2norm,
scale, key heads expanded to value heads), the split of packed tokens into rows, and the token-by-token
recurrence, whose gate is one log decay per value head (GDN) or per key channel (KDA).

It imports only torch and nothing of the kernels or their torch twins, so a kernel bug cannot hide in a helper the
oracles share with it. Layout: packed varlen tokens; q, k `[T, H, K]`, v `[T, HV, V]`, beta `[T, HV]`,
`cu_seqlens [N + 1]` row offsets (None = one row), states `[N, HV, K, V]` (rows = key channels); value head `hv`
reads key head `hv // (HV // H)`.
"""

from __future__ import annotations

import torch

L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + 1e-6) over the last dim, fp32."""
    x = x.float()
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def row_spans(num_tokens: int, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int]]:
    """(start, end) of each row of packed tokens."""
    if cu_seqlens is None:
        return [(0, num_tokens)]
    cu = [int(c) for c in cu_seqlens.tolist()]
    return list(zip(cu[:-1], cu[1:]))


def expand_heads(x: torch.Tensor, num_v_heads: int) -> torch.Tensor:
    """[T, H, K] -> [T, HV, K]: value head hv reads key head hv // (HV // H)."""
    return x.repeat_interleave(num_v_heads // x.shape[-2], dim=-2)


def prepare(q, k, v, g, beta, scale):
    """(q̂ · scale, k̂) expanded to the value heads, and v, g, beta, all fp32; scale None: K^-1/2."""
    num_v_heads = v.shape[-2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q_hat = expand_heads(l2norm(q) * scale, num_v_heads)
    k_hat = expand_heads(l2norm(k), num_v_heads)
    return q_hat, k_hat, v.float(), g.float(), beta.float()


def recurrent_delta_rule(q, k, v, g, beta, *, round_state_to=None, **options):
    """Token by token, g `[T, HV]` (one decay per value head) or `[T, HV, K]` (per key channel):
    S <- diag(e^g) S;  u = beta (v - S^T k̂);  S <- S + k̂ u^T;  o = S^T q̂.
    Returns `(o [T, HV, V] fp32, final_state [N, HV, K, V] fp32)`; `options`: scale, initial_state, cu_seqlens.
    round_state_to: round the running state to this dtype after every token (the storage rounding of the native
    and compact modes); a token's output is read before its rounding."""

    def token(S, qc, kc, vc, bc, G):  # the chunked driver's views of one token: [HV, 1, ...]
        S = S * G.exp().reshape(S.shape[0], -1, 1)
        u = bc * (vc[:, 0] - torch.einsum("hkv,hk->hv", S, kc[:, 0]))
        S = S + kc[:, 0, :, None] * u[:, None, :]
        o = torch.einsum("hkv,hk->hv", S, qc[:, 0])
        if round_state_to is not None:
            S = S.to(round_state_to).float()
        return o[:, None], S

    return chunked_delta_rule(q, k, v, g, beta, token, chunk_size=1, **options)


def chunked_delta_rule(q, k, v, g, beta, chunk, *, scale=None, initial_state=None, cu_seqlens=None, chunk_size=64):
    """The chunked form's driver: each row in chunks of `chunk_size` tokens, head-major. `chunk(S, qc, kc, vc, bc,
    G)` gets the state at the chunk's start, the chunk's q̂, k̂, v `[HV, C, ...]`, beta `[HV, C]` and its cumulative
    log decays G (the running sum of g over the chunk's tokens: `[HV, C]` or `[HV, C, K]`), and returns the chunk's
    outputs `[HV, C, V]` and the state after it. Returns `(o [T, HV, V] fp32, final_state [N, HV, K, V] fp32)`."""
    q_hat, k_hat, v, g, beta = prepare(q, k, v, g, beta, scale)
    num_v_heads, head_k, head_v = v.shape[1], k.shape[-1], v.shape[-1]
    o = torch.zeros_like(v)
    finals = []
    for i, (start, end) in enumerate(row_spans(q.shape[0], cu_seqlens)):
        S = torch.zeros(num_v_heads, head_k, head_v) if initial_state is None else initial_state[i].float().clone()
        for c0 in range(start, end, chunk_size):
            c1 = min(c0 + chunk_size, end)
            qc, kc, vc = q_hat[c0:c1].transpose(0, 1), k_hat[c0:c1].transpose(0, 1), v[c0:c1].transpose(0, 1)
            G = g[c0:c1].transpose(0, 1).cumsum(1)
            oc, S = chunk(S, qc, kc, vc, beta[c0:c1].transpose(0, 1), G)
            o[c0:c1] = oc.transpose(0, 1)
        finals.append(S)
    return o, torch.stack(finals)


def chunk_masks(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(s <= t, s < t) over a chunk's token pairs `[C, C]` (row t, column s)."""
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    return causal, causal.tril(-1)


def solve_unit_lower(A: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """U with (I + A) U = rhs, A strictly lower triangular `[HV, C, C]`."""
    eye = torch.eye(A.shape[-1]).expand_as(A)
    return torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
