"""The MoE layer shapes of the served checkpoints: what the tuning script, the GPU check and the benchmark run."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoEShape:
    name: str
    num_experts: int
    top_k: int
    hidden: int
    # per-rank expert intermediate size (the full one at tp 1)
    inter: int
    # "softmax" (Qwen) or "sigmoid" (Kimi)
    scoring: str = "softmax"

    def sharded(self, tp: int) -> MoEShape:
        assert self.inter % tp == 0, f"{self.name}: intermediate {self.inter} not divisible by tp {tp}"
        return MoEShape(
            f"{self.name}-tp{tp}", self.num_experts, self.top_k, self.hidden, self.inter // tp, self.scoring
        )

    def expert_bytes(self, itemsize: int) -> int:
        """Bytes of one expert's weights (gate, up and down)."""
        return 3 * self.hidden * self.inter * itemsize


SERVED_SHAPES = {
    s.name: s
    for s in (
        MoEShape("qwen3.5-35b-a3b", 256, 8, 2048, 512),
        MoEShape("qwen3-next-80b-a3b", 512, 10, 2048, 512),
        MoEShape("kimi-linear-48b-a3b", 256, 8, 2304, 1024, "sigmoid"),
        MoEShape("qwen3.5-397b-a17b", 512, 10, 4096, 1024),
    )
}
