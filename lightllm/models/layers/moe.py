"""Mixture of experts: Qwen's softmax router with a sigmoid-gated shared expert, Kimi's biased sigmoid router.

Experts are stored stacked (`gate_up [E, 2I, H]`, `down [E, H, I]`, TP shards of I) whatever the checkpoint
layout: per-expert tensors (`experts.{e}.gate_proj` / Kimi's `w1, w3, w2`) or already fused
(`experts.gate_up_proj`, `experts.down_proj`). On CUDA the block runs fused (`lightllm.kernels.fused_moe`: device routing, grouped
GEMMs, a fixed-order combine with the shared expert folded in; no host sync, so it runs inside CUDA graphs). On
CPU the routed sum is computed expert by expert over the tokens that chose it (`run_experts`): the reference the
fused path is tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightllm.kernels.fused_moe import fused_experts, sigmoid_topk, softmax_topk
from lightllm.kernels.fused_moe.warmup import warmup_fused_moe
from lightllm.models.config import MoEConfig
from lightllm.models.layers.mlp import SwiGLU
from lightllm.models.layers.quantized_linear import Fp8Weight, LinearWeight, linear, set_weight, stack_experts
from lightllm.models.loader import Shapes, WeightLoader


def route_softmax(logits: torch.Tensor, cfg: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen: softmax over all experts (fp32), top-k, optional renormalisation. Returns (weights, ids) [T, k]."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, cfg.top_k, dim=-1)
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


def route_sigmoid(logits: torch.Tensor, bias: torch.Tensor, cfg: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Kimi/DeepSeek-V3: sigmoid scores; the choice uses score + bias, restricted to the best `topk_groups`
    groups (a group scores the sum of its two best experts); weights are the unbiased scores, renormalised,
    times `routed_scaling_factor`. fp32 throughout."""
    scores = torch.sigmoid(logits.float())
    choice = scores + bias
    if cfg.num_groups > 1:
        grouped = choice.view(-1, cfg.num_groups, cfg.num_experts // cfg.num_groups)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(cfg.topk_groups, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(cfg.num_experts // cfg.num_groups, dim=1), float("-inf"))
    ids = torch.topk(choice, cfg.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, ids


def run_experts(
    x: torch.Tensor, gate_up: LinearWeight, down: LinearWeight, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """`x [T, H]`, `ids, weights [T, k]` -> `sum_k weights · expert_ids(x)` as `[T, H]` in x's dtype (block-FP8
    experts through `linear`'s W8A8 path)."""
    out = torch.zeros_like(x)
    num_experts = gate_up.shape[0]
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    top_k = ids.shape[1]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        sel = order[start : start + n]
        start += n
        tokens = sel // top_k
        g, u = linear(x[tokens], gate_up[e]).chunk(2, dim=-1)
        y = linear(F.silu(g) * u, down[e]) * weights.flatten()[sel, None]
        out.index_add_(0, tokens, y.to(x.dtype))
    return out


class MoE(nn.Module):
    """Router + routed experts + shared expert(s). Output is a TP partial sum (experts sharded along I)."""

    def __init__(self, cfg: MoEConfig, kimi_names: bool):
        super().__init__()
        self.cfg = cfg
        # Kimi spells the expert projections w1 (gate), w3 (up), w2 (down) and its shared MLP `shared_experts`
        self.expert_names = ("w1", "w3", "w2") if kimi_names else ("gate_proj", "up_proj", "down_proj")
        self.shared_prefix = "shared_experts." if kimi_names else "shared_expert."
        self.shared = SwiGLU(cfg.shared_intermediate_size) if cfg.shared_intermediate_size else None
        # [E + 1, H]: the router's rows and the shared expert's gate row, when one GEMM can give both (see load)
        self.register_buffer("router_and_gate", None)

    def _fused(self, prefix: str, available: set[str] | None) -> bool:
        return available is not None and f"{prefix}experts.gate_up_proj" in available

    def checkpoint_shapes(self, prefix: str, hidden: int, available: set[str] | None = None) -> Shapes:
        c, i = self.cfg, self.cfg.intermediate_size
        shapes = {f"{prefix}gate.weight": (c.num_experts, hidden)}
        if c.score_correction_bias:
            shapes[f"{prefix}gate.e_score_correction_bias"] = (c.num_experts,)
        if self._fused(prefix, available):
            shapes[f"{prefix}experts.gate_up_proj"] = (c.num_experts, 2 * i, hidden)
            shapes[f"{prefix}experts.down_proj"] = (c.num_experts, hidden, i)
        else:
            for e in range(c.num_experts):
                shapes.update(SwiGLU(i, self.expert_names).checkpoint_shapes(f"{prefix}experts.{e}.", hidden))
        if self.shared is not None:
            shapes.update(self.shared.checkpoint_shapes(prefix + self.shared_prefix, hidden))
        if c.shared_expert_gate:
            shapes[f"{prefix}shared_expert_gate.weight"] = (1, hidden)
        return shapes

    def load(self, w: WeightLoader, prefix: str) -> None:
        kimi = self.cfg.scoring == "sigmoid"
        self.register_buffer("router", w.get(f"{prefix}gate.weight", fp32=kimi))
        if self.cfg.score_correction_bias:
            self.register_buffer("score_bias", w.get(f"{prefix}gate.e_score_correction_bias"))
        gate_up, down = self._load_experts(w, prefix)
        set_weight(self, "gate_up", gate_up)
        set_weight(self, "down", down)
        if self.shared is not None:
            self.shared.load(w, prefix + self.shared_prefix)
        if self.cfg.shared_expert_gate:
            self.register_buffer("shared_gate", w.get(f"{prefix}shared_expert_gate.weight"))
            if self.router.dtype == self.shared_gate.dtype:
                # one GEMM gives the router's logits and the shared expert's gate logit: a decode step would
                # otherwise spend a launch per layer on a one-row GEMM; router and gate stay views of it
                self.router_and_gate = torch.cat([self.router, self.shared_gate])
                self.router, self.shared_gate = self.router_and_gate[:-1], self.router_and_gate[-1:]

    def _load_experts(self, w: WeightLoader, prefix: str) -> tuple[LinearWeight, LinearWeight]:
        """Stacked `gate_up [E, 2I_local, H]` and `down [E, H, I_local]`: both FP8 or both in the model dtype (one
        decision over every expert tensor), quantized expert by expert to bound the load-time memory."""
        if w.has(f"{prefix}experts.gate_up_proj"):
            names = [f"{prefix}experts.gate_up_proj", f"{prefix}experts.down_proj"]
            gate, up = w.get_linear(names[0]).chunk(2, dim=1)
            gate_up = torch.cat([w.tp.shard(gate, 1), w.tp.shard(up, 1)], dim=1)
            down = w.get_linear(names[1], 2)
            quantize = w.quantizes(*names)
            return tuple(
                stack_experts((w.linear(t[e], quantize=quantize) for e in range(t.shape[0])), t.shape[0])
                for t in (gate_up, down)
            )
        experts = range(self.cfg.num_experts)
        g, u, d = ([f"{prefix}experts.{e}.{n}.weight" for e in experts] for n in self.expert_names)
        quantize = w.quantizes(*g, *u, *d)
        gate_up = (
            w.linear(torch.cat([w.get_linear(g[e], 0), w.get_linear(u[e], 0)]), quantize=quantize) for e in experts
        )
        down = (w.linear(w.get_linear(d[e], 1), quantize=quantize) for e in experts)
        return stack_experts(gate_up, len(experts)), stack_experts(down, len(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return self.forward_fused(x)
        if self.cfg.scoring == "sigmoid":
            weights, ids = route_sigmoid(F.linear(x.float(), self.router), self.score_bias, self.cfg)
        else:
            weights, ids = route_softmax(F.linear(x, self.router), self.cfg)
        out = run_experts(x, self.gate_up, self.down, weights, ids)
        if self.shared is not None:
            shared = self.shared(x)
            if self.cfg.shared_expert_gate:
                shared = torch.sigmoid(F.linear(x, self.shared_gate)) * shared
            out = out + shared
        return out

    def forward_fused(self, x: torch.Tensor) -> torch.Tensor:
        """The same block through the Triton kernels (CUDA; on CPU only under the Triton interpreter)."""
        c = self.cfg
        if c.scoring == "sigmoid":
            logits = F.linear(x.float(), self.router)
            weights, ids = sigmoid_topk(
                logits, self.score_bias, c.top_k, c.norm_topk_prob, c.routed_scaling_factor, c.num_groups, c.topk_groups
            )
            gate = F.linear(x, self.shared_gate) if c.shared_expert_gate else None
        else:
            if self.router_and_gate is not None:
                both = F.linear(x, self.router_and_gate)
                logits, gate = both[:, :-1], both[:, -1:]
            else:
                logits = F.linear(x, self.router)
                gate = F.linear(x, self.shared_gate) if c.shared_expert_gate else None
            weights, ids = softmax_topk(logits, c.top_k, c.norm_topk_prob)
        shared = self.shared(x) if self.shared is not None else None
        if isinstance(self.gate_up, Fp8Weight):
            scales = {"gate_up_scale": self.gate_up.weight_scale_inv, "down_scale": self.down.weight_scale_inv}
            return fused_experts(
                x, self.gate_up.weight, self.down.weight, weights, ids, shared, gate, block=self.gate_up.block, **scales
            )
        return fused_experts(x, self.gate_up, self.down, weights, ids, shared, gate)

    def warmup_fused(self, max_tokens: int, act_dtype: torch.dtype | None = None) -> int:
        """Compile the fused path's kernels for every batch bucket of 1 .. `max_tokens` tokens with the layer's own
        expert weights and scratch activations (call at start-up on CUDA, before serving; once per distinct layer
        shape is enough); returns the launch sequences run. FP8 experts need `act_dtype`, the model's activation
        dtype (0 launches without it)."""
        c = self.cfg
        common = dict(
            shared=self.shared is not None,
            shared_gate=c.shared_expert_gate,
            gate_beside_logits=self.router_and_gate is not None,
        )
        if not isinstance(self.gate_up, Fp8Weight):
            return warmup_fused_moe(
                self.gate_up, self.down, c.top_k, max_tokens, c.scoring, c.num_groups, c.topk_groups, **common
            )
        if act_dtype is None:
            return 0
        return warmup_fused_moe(
            self.gate_up.weight,
            self.down.weight,
            c.top_k,
            max_tokens,
            c.scoring,
            c.num_groups,
            c.topk_groups,
            act_dtype=act_dtype,
            gate_up_scale=self.gate_up.weight_scale_inv,
            down_scale=self.down.weight_scale_inv,
            block=self.gate_up.block,
            **common,
        )
