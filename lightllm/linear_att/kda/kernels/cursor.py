"""KDA per-slot scalars after MTP acceptance (`kernels/cursor.py`): native's current window slot and
replay's cursor / parity, with the conv offset. They hold no gate, so the shared ops are the entry points."""

from lightllm.linear_att.ops import native_accept, replay_accept

__all__ = ["native_accept", "replay_accept"]
